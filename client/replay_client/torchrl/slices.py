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

Thread-safety: immutable (the masks cached for full slices are never written).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from replay_client.errors import InvalidArgumentError
from replay_proto.batch import SampleBatch
from replay_proto.keys import KEY_SEPARATOR
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

    def cut(self, drawn: SampleBatch, weights: bool = True) -> FlatSlices:
        """A drawn ``[num_slices, slice_len]`` batch as TorchRL's flat batch (see
        :class:`FlatSlices`): the slices' steps one after the other, as stored
        (``num_slices * slice_len`` of them, fewer when partial slices are cut; their flags
        untouched, as TorchRL's storage returns them), and the markers by key (what
        TorchRL's sampler puts in ``info``, and its TensorDict buffers in the batch).

        Plain tensors throughout (a TensorDict operation costs as much as a small
        tensor's copy); a batch of full slices takes its markers from masks made once per
        ``(num_slices, slice_len)`` (:func:`_slice_marks`), copied where handed out.

        Args:
            drawn: the sample as the table drew it.
            weights: also give each step its slice's weight (prioritized tables).
        """
        count, length = drawn.ids.shape[:2]
        size = count * length
        columns = {key: value.reshape(size, *value.shape[2:])
                   for key, value in drawn.columns.items()}
        out = FlatSlices(columns, drawn.ids.reshape(size),
                         drawn.weights.repeat_interleave(length) if weights else None)
        real = real_steps(drawn.ids) if self.partial else None
        if real is None or bool(real.all()):
            ends, starts = _slice_marks(count, length)
            self._mark(out, ends.clone(), starts)
            return out
        lengths = real.sum(-1)
        if self.pad_output:  # TorchRL leaves the mask out while nothing is short
            starts_at = torch.arange(count) * length
            out.markers[MASK_KEY] = real.reshape(-1)
        else:
            keep = real.reshape(-1)
            out.columns = {key: value[keep] for key, value in columns.items()}
            out.ids = out.ids[keep]
            out.weights = None if out.weights is None else out.weights[keep]
            starts_at = lengths.cumsum(0) - lengths
        steps = out.ids.shape[0]
        self._mark(out, _mask(steps, starts_at + lengths - 1), _mask(steps, starts_at))
        return out

    def _mark(self, out: FlatSlices, ends: torch.Tensor, starts: torch.Tensor) -> None:
        """TorchRL's markers: slice ends truncated (and done), slice starts ``is_init``.

        ``ends`` becomes the truncated marker (this sample's own tensor); ``starts`` is only
        read."""
        if self.truncated_key is not None:
            key = self.truncated_key
            out.markers[key] = _shaped(ends, out.stored(key))
            done_key = _sibling(key, "done")
            done = out.stored(done_key)
            out.markers[done_key] = (_shaped(ends, None) if done is None
                                     else done | _shaped(ends, done))
            terminated_key = _sibling(key, "terminated")
            terminated = out.stored(terminated_key)
            out.markers[terminated_key] = (torch.zeros_like(out.markers[key])
                                           if terminated is None else terminated)
        if self.init_key is not None:
            stored = out.stored(self.init_key)
            if stored is not None:
                out.markers[self.init_key] = stored | _shaped(starts, stored)


@dataclass(slots=True)
class FlatSlices:
    """A slice sample as TorchRL's flat batch of steps, in plain tensors.

    Attributes:
        columns: the steps' columns by flat key (``"next.done"``), ``[steps, ...]``.
        ids: int64 ``[steps]``, each step's row id.
        weights: float32 ``[steps]``, each step's slice weight (``None``: not asked for).
        markers: TorchRL's trajectory markers by (nested) key, each a tensor of this sample's
            own (never one a later sample shares) or a stored column.
    """

    columns: dict[str, torch.Tensor]
    ids: torch.Tensor
    weights: torch.Tensor | None
    markers: dict[Any, torch.Tensor] = field(default_factory=dict)

    def stored(self, key: Any) -> torch.Tensor | None:
        """The stored column at the (nested) TensorDict ``key``, or ``None``."""
        parts = key if isinstance(key, tuple) else (key,)
        if any(KEY_SEPARATOR in part for part in parts):
            return None  # a TensorDict key, not a path: no stored column has that name
        return self.columns.get(KEY_SEPARATOR.join(parts))


@functools.lru_cache(maxsize=64)
def _slice_marks(count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[count * length]`` masks of full slices' last and first steps (cached: read,
    or copied before handed out, never written)."""
    ends = torch.zeros(count, length, dtype=torch.bool)
    ends[:, -1] = True
    starts = torch.zeros(count, length, dtype=torch.bool)
    starts[:, 0] = True
    return ends.reshape(-1), starts.reshape(-1)


def _mask(steps: int, at: torch.Tensor) -> torch.Tensor:
    """Bool ``[steps]``, True at the positions ``at``."""
    mask = torch.zeros(steps, dtype=torch.bool)
    mask[at] = True
    return mask


def _shaped(mark: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``mark`` (bool ``[n]``) in the shape of the stored flag ``like`` (TorchRL's ``[n, 1]``
    where none is stored)."""
    if like is None:
        return mark.unsqueeze(-1)
    return mark.reshape(-1, *([1] * (like.dim() - 1))).expand(like.shape).to(like.device)
