"""Data that is not a TensorDict, in and out: plain tensors, tensorclasses, dicts and tuples.

TorchRL's ``ReplayBuffer`` stores whatever it is given (a tensor, a
tensorclass, a nested tuple of tensors) and samples come back as the same
kind. A table stores columns, so :class:`DataKind` turns what a buffer is
given into a TensorDict of rows (its leading dimension) and samples back
into that kind:

* a TensorDict: as it is;
* a tensorclass: its TensorDict; samples are that tensorclass again;
* a tensor: one column, ``"_data"``; samples are tensors;
* a list of TensorDicts, of tensors or of numbers: one row each (stacked),
  as TorchRL's ``ListStorage`` takes them;
* a pytree of tensors (dicts, tuples and lists, nested: torch's pytree): its
  leaves as columns ``"_0"``, ``"_1"``, ...; samples are the same structure.

The first data a buffer writes fixes its kind (as the first insert fixes a
table's schema); data of another kind later is refused with a message
naming both.

Thread-safety: a kind is fixed once, then read only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from replay_client.errors import InvalidArgumentError

TENSOR_KEY = "_data"
"""The column a buffer of plain tensors keeps them in."""


class DataKind:
    """What a buffer is given and returns (see the module docstring)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._cls: Any = None
        self._structure: Any = None

    def encode(self, data: Any, *, single: bool = False) -> TensorDictBase:
        """``data`` as a TensorDict of rows (``single``: one row, no leading dimension)."""
        name, encoded = self._encoded(data, single)
        if self.name is None:
            self.name = name
        elif name != self.name:
            raise InvalidArgumentError(
                f"this buffer holds {self.name} data; got {name} (a buffer keeps one kind)")
        return encoded

    def decode(self, sample: TensorDictBase) -> Any:
        """A sample (data columns only) as the kind the buffer was given."""
        if self.name in (None, "tensordict"):
            return sample
        if self.name == "tensorclass":
            return self._cls.from_tensordict(sample)
        if self.name == "tensor":
            return sample.get(TENSOR_KEY)
        return tree_unflatten([sample.get(f"_{i}") for i in range(len(sample.keys()))],
                              self._structure)

    def _encoded(self, data: Any, single: bool) -> tuple[str, TensorDictBase]:
        if is_tensorclass(data):
            self._cls = self._cls or type(data)
            return "tensorclass", data.to_tensordict()
        if isinstance(data, TensorDictBase):
            return "tensordict", data
        if (isinstance(data, (tuple, list)) and data and not single
                and all(isinstance(v, TensorDictBase) for v in data)):
            return "tensordict", torch.stack(list(data))  # one row per TensorDict
        if isinstance(data, list) and data and not single and all(
                isinstance(v, (torch.Tensor, int, float, bool)) for v in data):
            data = torch.stack([torch.as_tensor(v) for v in data])  # one row per element
        if isinstance(data, torch.Tensor):
            return "tensor", TensorDict({TENSOR_KEY: data},
                                        batch_size=[] if single else data.shape[:1])
        if isinstance(data, (Mapping, tuple, list)) and data:
            leaves, spec = tree_flatten(data)
            if leaves and all(isinstance(v, (torch.Tensor, int, float, bool)) for v in leaves):
                if self._structure is None:
                    self._structure = spec
                columns = {f"_{i}": torch.as_tensor(v) for i, v in enumerate(leaves)}
                return "tree", TensorDict(columns, batch_size=_rows(list(columns.values()),
                                                                    single))
        raise InvalidArgumentError(
            f"a replay buffer on a server stores tensors: a TensorDict, a tensorclass, a tensor, "
            f"or a dict, tuple or list of tensors; got {type(data).__name__}")


def _rows(leaves: list[Any], single: bool) -> list[int]:
    if single or not leaves:
        return []
    first = torch.as_tensor(leaves[0])
    return list(first.shape[:1])


