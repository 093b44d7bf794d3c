"""What a row is: TorchRL's elements along the first dimension, or a collector's steps.

TorchRL's (one-dimensional) storages keep one element per index of a
TensorDict's *first* batch dimension: ``extend`` of a ``[n, T]`` TensorDict
stores ``n`` rows of ``T`` steps each, and samples come back ``[B, T]``. A
row table (no episodes) does the same: the other batch dimensions are part
of each row (its columns are ``[T, ...]`` per row) and are restored on
samples, ``"index"`` expanded over them as TorchRL sets it.

A table that keeps episodes (slice tables) takes a ``[*envs, T]``
TensorDict as steps instead: ``n_envs * T`` rows, each env's steps in order
(:mod:`replay_proto.rows`), because its slices are cut from those steps.

Thread-safety: one writer (the first write fixes the row's dimensions).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from replay_client.errors import InvalidArgumentError
from replay_proto.rows import EpisodeTracker, rows_of


def expand_right(value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``value`` (``[B, ...extra]`` over a batch's first dim) spread over the batch ``shape``."""
    lead = value.shape[0]
    extra = value.shape[1:]
    if tuple(shape) == (lead,):
        return value
    view = value.reshape(lead, *([1] * (len(shape) - 1)), *extra)
    return view.expand(*shape, *extra)


class RowShape:
    """Columns of written TensorDicts, and samples reshaped back (see the module docstring).

    Args:
        steps: the table keeps episodes: ``[*envs, T]`` batches are steps.
    """

    def __init__(self, steps: bool) -> None:
        self.steps = steps
        self.dims: tuple[int, ...] = ()
        """A row's own batch dimensions (``(T,)`` after an extend of ``[n, T]``)."""
        self._fixed = False

    def columns(self, td: TensorDictBase, episode_key: str,
                tracker: EpisodeTracker) -> dict[str, Any]:
        """Flat columns, rows first, of ``td`` (batch dims ``[n, *row dims]``)."""
        if self.steps or td.batch_dims <= 1:
            return rows_of(td, episode_key=episode_key, tracker=tracker)
        dims = tuple(td.batch_size[1:])
        if self._fixed and dims != self.dims:
            raise InvalidArgumentError(
                f"this buffer's rows have batch dims {list(self.dims)} after the first; got "
                f"{list(dims)} (TorchRL's storages keep one shape too)")
        self.dims, self._fixed = dims, True
        flat = td.contiguous().copy()  # a lazy stack cannot change its batch size
        flat.batch_size = td.batch_size[:1]
        return rows_of(flat)

    def wrote(self, td: TensorDictBase) -> None:
        """Note the row dims of a one-row write (``add``) of a TensorDict ``[1, *row dims]``."""
        if not self.steps and not self._fixed and td.batch_dims > 1:
            self.dims, self._fixed = tuple(td.batch_size[1:]), True

    def index(self, ids: torch.Tensor, td: TensorDictBase) -> torch.Tensor:
        """The ids as ``td["index"]``: shaped like ``td``'s batch (its rows' dims too)."""
        if self.steps:
            return ids.reshape(td.batch_size)
        return expand_right(ids, td.batch_size)

    @property
    def restores(self) -> bool:
        """Whether :meth:`restore` changes a sample's batch size (rows with dims of their own)."""
        return not self.steps and bool(self.dims)

    def restore(self, sample: TensorDictBase) -> TensorDictBase:
        """A sample ``[B]`` of rows as ``[B, *row dims]``."""
        if not self.restores:
            return sample
        sample.batch_size = torch.Size([sample.batch_size[0], *self.dims])
        return sample

    def reset(self) -> None:
        self.dims, self._fixed = (), False
