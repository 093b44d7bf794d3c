"""What TorchRL code passes as an ``index``: storage positions, or the ids samples carry.

TorchRL's buffers name rows by *storage position* (``0 .. capacity - 1``):
``rb[3]``, ``rb[:n]``, ``rb.update_priority(torch.arange(n), p)``, and a
sample's ``"index"``. A replay server names them by id (int64, never reused):
a :class:`~replay_client.torchrl.buffer.RemoteReplayBuffer` sample holds the
positions under ``"index"``, as TorchRL's, and the ids under :data:`ID_KEY`
(``update_tensordict_priority`` uses them, so stale rows are left alone;
:mod:`replay_client.id_positions` turns ids into positions). Both kinds reach :class:`~replay_client.torchrl.buffer.RemoteReplayBuffer`,
and they cannot be confused: a server's ids carry its id incarnation (bits
40..55, never 0 on a server), so every id is at least ``2**40``, and every
position is below the capacity (at most ``2**40``). :func:`split_index`
tells them apart; a mix of both in one index is refused.

Positions are the server's (``ReplayClient.read``): rows are written at 0, 1,
2, ... from the table's creation or last reset, wrapping at capacity, as in
TorchRL's storages.

Thread-safety: pure functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_client.errors import InvalidArgumentError
from replay_proto.id_layout import SEGMENT_ROWS

ID_KEY = "replay_id"
"""Where samples (and extended TensorDicts) carry the rows' ids, beside TorchRL's ``"index"``."""

ID_FLOOR = SEGMENT_ROWS
"""Every id a server issues is at least this (``2**40``); every storage position is below it."""


def as_index_array(index: Any, size: int) -> np.ndarray:
    """An integer index (int, slice, sequence, tensor, bool mask) as int64 values, flat.

    A ``slice`` and negative integers count over the ``size`` rows stored
    (``rb[-1]`` is the row at position ``size - 1``), as in TorchRL's storages.
    """
    if isinstance(index, slice):
        return np.arange(size, dtype=np.int64)[index]
    if isinstance(index, range):
        return np.asarray(index, dtype=np.int64)
    tensor = torch.as_tensor(index).detach().cpu()
    if tensor.dtype == torch.bool:
        return torch.nonzero(tensor.reshape(-1)).reshape(-1).numpy().astype(np.int64)
    if tensor.dtype.is_floating_point or tensor.is_complex():
        raise InvalidArgumentError(f"an index must hold integers, got {tensor.dtype}")
    values = tensor.to(torch.int64).numpy().reshape(-1)
    return np.where(values < 0, values + size, values)


def split_index(values: np.ndarray) -> str:
    """``"ids"`` or ``"positions"``: what the int64 ``values`` are.

    Raises:
        InvalidArgumentError: ids and positions mixed, or negative values.
    """
    if values.size == 0:
        return "positions"
    if (values < 0).any():
        raise InvalidArgumentError(
            f"index {int(values[values < 0][0])} is negative beyond the rows stored; an index "
            f"holds storage positions (0..capacity-1) or the ids samples return")
    ids = values >= ID_FLOOR
    if ids.all():
        return "ids"
    if ids.any():
        raise InvalidArgumentError(
            f"an index mixes ids (e.g. {int(values[ids][0])}, from a sample's 'index') with "
            f"storage positions (e.g. {int(values[~ids][0])}); pass one kind")
    return "positions"
