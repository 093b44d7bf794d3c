"""Slice tables the TorchRL way: ``batch_size`` counts steps, samples are flat ``[batch_size]``.

TorchRL's ``SliceSampler`` returns ``num_slices`` slices of ``slice_len``
steps as one flat batch of ``batch_size = num_slices * slice_len`` steps, each
slice's steps consecutive and in order, and marks the breaks it made in the
trajectories: ``("next", "truncated")`` is True at every slice's last step,
``("next", "done")`` is the stored flag OR that mark (False where none is
stored), ``("next", "terminated")`` the stored flag (else False), and a
stored ``"is_init"`` is OR-ed with True at every slice's first step. Value
estimators and recurrent modules read those markers.

A slice table draws ``[num_slices, slice_len]`` (its ``slice_len`` is its
config's); :class:`SliceLayout` says how many slices a batch of steps needs
and turns a drawn ``[num_slices, slice_len]`` batch into TorchRL's flat one.
A batch size that is not a whole number of slices is refused, naming the
sizes that are (TorchRL refuses it too).

Thread-safety: immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from replay_client.errors import InvalidArgumentError

TRUNCATED_KEY = ("next", "truncated")
INIT_KEY = "is_init"


def _sibling(key: Any, last: str) -> Any:
    """``key`` with its last part replaced: ``("next", "truncated")`` -> ``("next", "done")``."""
    return (*key[:-1], last) if isinstance(key, tuple) else last


@dataclass(frozen=True, slots=True)
class SliceLayout:
    """How a slice table's draws become TorchRL's flat batches.

    Attributes:
        slice_len: steps per slice (the table's ``slice_len``).
        num_slices: slices per batch, when the buffer's sampler fixed it (TorchRL's
            ``num_slices``); ``None``: ``batch_size // slice_len``.
        truncated_key: where slice ends are marked (``None``: no markers).
        init_key: the stored key OR-ed with slice starts (``None``: left as stored).
    """

    slice_len: int
    num_slices: int | None = None
    truncated_key: Any = TRUNCATED_KEY
    init_key: Any = INIT_KEY

    def slices_for(self, batch_size: int) -> int:
        """How many slices a batch of ``batch_size`` steps holds.

        Raises:
            InvalidArgumentError: ``batch_size`` is not a whole number of slices.
        """
        length = self.slice_len
        if self.num_slices is not None and batch_size != self.num_slices * length:
            raise InvalidArgumentError(
                f"batch_size={batch_size} with num_slices={self.num_slices} asks for slices of "
                f"{batch_size / self.num_slices:g} steps, and the table's slice_len is {length}: "
                f"sample {self.num_slices * length} steps, or set the table's slice_len")
        if batch_size % length:
            raise InvalidArgumentError(
                f"batch_size={batch_size} is not a whole number of slices of the table's "
                f"slice_len={length}: batch_size counts steps (as TorchRL's SliceSampler), so "
                f"ask for a multiple of {length} (e.g. {max(1, batch_size // length) * length})")
        return batch_size // length

    def flatten(self, drawn: TensorDictBase) -> tuple[TensorDictBase, dict[Any, torch.Tensor]]:
        """A ``[num_slices, slice_len]`` sample as TorchRL's flat one, and its markers.

        Returns:
            ``(flat, markers)``: the ``[num_slices * slice_len]`` batch as stored (its flags
            untouched, as TorchRL's storage returns them) and the markers by key (what
            TorchRL's sampler puts in ``info``, and its TensorDict buffers in the batch).
        """
        flat = drawn.reshape(-1)
        count, length = drawn.batch_size[0], drawn.batch_size[1]
        markers: dict[Any, torch.Tensor] = {}
        if self.truncated_key is not None:
            ends = torch.zeros(count, length, dtype=torch.bool)
            ends[:, -1] = True
            key = self.truncated_key
            markers[key] = _shaped(ends.reshape(-1), flat.get(key, None))
            done_key = _sibling(key, "done")
            done = flat.get(done_key, None)
            markers[done_key] = (_shaped(ends.reshape(-1), None) if done is None
                                 else done | _shaped(ends.reshape(-1), done))
            terminated_key = _sibling(key, "terminated")
            terminated = flat.get(terminated_key, None)
            markers[terminated_key] = (torch.zeros_like(markers[key]) if terminated is None
                                       else terminated)
        if self.init_key is not None:
            stored = flat.get(self.init_key, None)
            if stored is not None:
                starts = torch.zeros(count, length, dtype=torch.bool)
                starts[:, 0] = True
                markers[self.init_key] = stored | _shaped(starts.reshape(-1), stored)
        return flat, markers


def _shaped(mark: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``mark`` (bool ``[n]``) in the shape of the stored flag ``like`` (TorchRL's ``[n, 1]``
    where none is stored)."""
    if like is None:
        return mark.unsqueeze(-1)
    return mark.reshape(-1, *([1] * (like.dim() - 1))).expand(like.shape).to(like.device)
