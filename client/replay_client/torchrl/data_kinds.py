"""Data that is not a TensorDict, in and out: plain tensors, tensorclasses, dicts and tuples.

TorchRL's ``ReplayBuffer`` stores whatever it is given (a tensor, a
tensorclass, a nested tuple of tensors) and samples come back as the same
kind. A table stores columns, so :class:`DataKind` turns what a buffer is
given into a TensorDict of rows (its leading dimension) and samples back
into that kind:

* a TensorDict: as it is;
* a tensorclass: its TensorDict; samples are that tensorclass again;
* a tensor: one column, ``"_data"``; samples are tensors;
* a mapping of tensors (nested allowed): a TensorDict of it; samples are dicts;
* a list of TensorDicts: one row each (stacked);
* a tuple or list of tensors (nested allowed): columns ``"_0"``, ``"_1"``, ...;
  samples are the same structure.

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
        if self.name == "mapping":
            return sample.to_dict()
        return _rebuild(self._structure, sample)

    def _encoded(self, data: Any, single: bool) -> tuple[str, TensorDictBase]:
        if is_tensorclass(data):
            self._cls = self._cls or type(data)
            return "tensorclass", data.to_tensordict()
        if isinstance(data, TensorDictBase):
            return "tensordict", data
        if (isinstance(data, (tuple, list)) and data and not single
                and all(isinstance(v, TensorDictBase) for v in data)):
            return "tensordict", torch.stack(list(data))  # one row per TensorDict
        if isinstance(data, torch.Tensor):
            return "tensor", TensorDict({TENSOR_KEY: data},
                                        batch_size=[] if single else data.shape[:1])
        if isinstance(data, Mapping):
            return "mapping", TensorDict(dict(data), batch_size=_rows(_leaves(data), single))
        if isinstance(data, (tuple, list)) and data and all(
                isinstance(v, (torch.Tensor, tuple, list, Mapping)) for v in data):
            columns: dict[str, Any] = {}
            structure = _flatten(data, "", columns)
            if self._structure is None:
                self._structure = structure
            return "sequence", TensorDict(columns, batch_size=_rows(list(columns.values()),
                                                                    single))
        raise InvalidArgumentError(
            f"a replay buffer on a server stores tensors: a TensorDict, a tensorclass, a tensor, "
            f"or a dict, tuple or list of tensors; got {type(data).__name__}")


def _leaves(data: Mapping) -> list[torch.Tensor]:
    out = []
    for value in data.values():
        out.extend(_leaves(value) if isinstance(value, Mapping) else [torch.as_tensor(value)])
    return out


def _rows(leaves: list[Any], single: bool) -> list[int]:
    if single or not leaves:
        return []
    first = torch.as_tensor(leaves[0])
    return list(first.shape[:1])


def _flatten(data: Any, prefix: str, columns: dict[str, Any]) -> Any:
    """Columns ``_0``, ``_1``, ``_1_0`` ... of a nested tuple/list; returns its structure."""
    if isinstance(data, (tuple, list)):
        return (type(data), [_flatten(v, f"{prefix}_{i}", columns) for i, v in enumerate(data)])
    if isinstance(data, Mapping):
        return (dict, {k: _flatten(v, f"{prefix}_{k}", columns) for k, v in data.items()})
    columns[prefix] = torch.as_tensor(data)
    return prefix


def _rebuild(structure: Any, sample: TensorDictBase) -> Any:
    if isinstance(structure, str):
        return sample.get(structure)
    kind, parts = structure
    if kind is dict:
        return {k: _rebuild(v, sample) for k, v in parts.items()}
    return kind(_rebuild(v, sample) for v in parts)
