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

Partial slices (TorchRL's ``strict_length=False`` and ``span``; the table's
``strict_length = false`` / ``span_right``) may be shorter than
``slice_len``; the table pads each window by repeating its last real step
(:mod:`replay_proto.slices`). Without ``pad_output`` the padding is cut, and
the batch holds fewer steps than asked for, the slices' real steps one after
the other, as TorchRL's; with ``pad_output`` it is kept (the last real step
repeated, as TorchRL pads) and ``("collector", "mask")`` (bool ``[B * T]``)
says which steps are real, in a batch that has a short slice (a batch of full
slices has none, as TorchRL's has none while no stored trajectory is short). The markers sit at each slice's last *real* step
and its first step either way.

Thread-safety: immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from replay_client.errors import InvalidArgumentError
from replay_proto.batch import SampleBatch
from replay_proto.slices import real_steps

TRUNCATED_KEY = ("next", "truncated")
INIT_KEY = "is_init"
MASK_KEY = ("collector", "mask")
"""Where a padded batch says which steps are real (TorchRL's ``pad_output`` mask)."""


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
        partial: the table's slices may be shorter than ``slice_len`` (its capabilities'
            ``partial_slices`` or a span): their padding is cut, or kept with a mask.
        pad_output: keep each slice ``slice_len`` long, padded with its last real step,
            and put :data:`MASK_KEY` in a batch that has a short slice (TorchRL's
            ``pad_output``: TorchRL puts it in while any *stored* trajectory is short,
            which a sample cannot see; with every trajectory long enough, neither has it).
    """

    slice_len: int
    num_slices: int | None = None
    truncated_key: Any = TRUNCATED_KEY
    init_key: Any = INIT_KEY
    partial: bool = False
    pad_output: bool = False

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

    @staticmethod
    def steps(drawn: SampleBatch) -> SampleBatch:
        """A drawn ``[num_slices, slice_len]`` batch as ``num_slices * slice_len`` steps, each
        with its slice's weight and probability: flat before it becomes a TensorDict (views
        of the drawn tensors; reshaping a TensorDict costs more)."""
        count, length = drawn.ids.shape[:2]
        columns = {key: value.reshape(count * length, *value.shape[2:])
                   for key, value in drawn.columns.items()}
        return SampleBatch.from_columns(
            columns, drawn.ids.reshape(-1), drawn.weights.repeat_interleave(length),
            drawn.probabilities.repeat_interleave(length), mass=drawn.mass,
            missing_shards=drawn.missing_shards)

    def flatten(self, flat: TensorDictBase, ids: torch.Tensor
                ) -> tuple[TensorDictBase, dict[Any, torch.Tensor]]:
        """A sample's :meth:`steps` (``flat``, ``[num_slices * slice_len]``) as TorchRL's flat
        batch, and its markers; ``ids``: the drawn ``[num_slices, slice_len]`` ids.

        Returns:
            ``(flat, markers)``: the slices' steps one after the other, as stored
            (``num_slices * slice_len`` of them, fewer when partial slices are cut;
            their flags untouched, as TorchRL's storage returns them) and the markers
            by key (what TorchRL's sampler puts in ``info``, and its TensorDict buffers
            in the batch).
        """
        count, length = ids.shape[0], ids.shape[1]
        real = real_steps(ids) if self.partial else None
        if real is None:
            lengths = torch.full((count,), length, dtype=torch.int64)
        else:
            lengths = real.sum(-1)
        markers: dict[Any, torch.Tensor] = {}
        if real is not None and self.pad_output:
            starts = torch.arange(count) * length
            if not bool(real.all()):  # TorchRL leaves the mask out while nothing is short
                markers[MASK_KEY] = real.reshape(-1)
        else:
            if real is not None and not bool(real.all()):
                flat = flat[real.reshape(-1)]
            starts = lengths.cumsum(0) - lengths
        self._mark(flat, markers, starts, starts + lengths - 1)
        return flat, markers

    def _mark(self, flat: TensorDictBase, markers: dict[Any, torch.Tensor],
              starts: torch.Tensor, ends: torch.Tensor) -> None:
        """TorchRL's markers: slice ends truncated (and done), slice starts ``is_init``."""
        steps = flat.batch_size[0]
        if self.truncated_key is not None:
            mark = torch.zeros(steps, dtype=torch.bool)
            mark[ends] = True
            key = self.truncated_key
            markers[key] = _shaped(mark, flat.get(key, None))
            done_key = _sibling(key, "done")
            done = flat.get(done_key, None)
            markers[done_key] = (_shaped(mark, None) if done is None
                                 else done | _shaped(mark, done))
            terminated_key = _sibling(key, "terminated")
            terminated = flat.get(terminated_key, None)
            markers[terminated_key] = (torch.zeros_like(markers[key]) if terminated is None
                                       else terminated)
        if self.init_key is not None:
            stored = flat.get(self.init_key, None)
            if stored is not None:
                mark = torch.zeros(steps, dtype=torch.bool)
                mark[starts] = True
                markers[self.init_key] = stored | _shaped(mark, stored)


def _shaped(mark: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``mark`` (bool ``[n]``) in the shape of the stored flag ``like`` (TorchRL's ``[n, 1]``
    where none is stored)."""
    if like is None:
        return mark.unsqueeze(-1)
    return mark.reshape(-1, *([1] * (like.dim() - 1))).expand(like.shape).to(like.device)
