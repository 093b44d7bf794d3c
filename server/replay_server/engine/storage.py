"""Column-wise row storage: one preallocated tensor per flat key.

Column ``key`` is a tensor of shape ``[capacity, *spec.shape]``; row ``slot``
of every column together is one stored row. Allocation happens once, up front
(pages are touched lazily by the OS as rows arrive), so inserts and samples
never allocate storage.

Copies in and out go through numpy views of the same memory: ``np.take`` and
``np.copyto`` are single-threaded memcpy loops, several times faster than
torch's indexing for row gathers and immune to OpenMP threads spinning on a
busy machine (bfloat16, which numpy lacks, travels as same-width int16).

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from replay_server.errors import ConfigError, InsufficientMemoryError
from replay_server.engine.schema import Schema
from replay_server.engine.snapshot import DEFAULT_CHUNK_BYTES, StorageSnapshot


class ColumnStorage:
    """Preallocated columns for ``capacity`` rows of ``schema``.

    Args:
        schema: the columns to allocate.
        capacity: rows per column.
        pin_memory: allocate page-locked (pinned) host memory so device copies
            can be asynchronous. Requires an accelerator.

    Raises:
        ConfigError: ``pin_memory`` is requested without an accelerator.
        InsufficientMemoryError: the allocation failed.
    """

    def __init__(self, schema: Schema, capacity: int, *, pin_memory: bool = False) -> None:
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory is true but no CUDA device is available: pinned storage would "
                "not help any copy; set pin_memory to false or 'auto'"
            )
        self.schema = schema
        self.capacity = capacity
        self.pinned = pin_memory
        try:
            self.columns: dict[str, torch.Tensor] = {
                key: torch.empty((capacity, *spec.shape), dtype=spec.dtype, pin_memory=pin_memory)
                for key, spec in schema.items()
            }
        except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as either
            raise InsufficientMemoryError(
                f"cannot allocate {capacity * schema.row_bytes:,} bytes of storage for "
                f"{capacity:,} rows of {schema.describe()}: {exc}") from None
        self._views = {key: _numpy_view(col) for key, col in self.columns.items()}
        self._snapshots: list[StorageSnapshot] = []

    @property
    def nbytes(self) -> int:
        """Bytes allocated for all columns."""
        return self.capacity * self.schema.row_bytes

    def write(self, first_slot: int, columns: Mapping[str, torch.Tensor]) -> None:
        """Write ``n`` rows at slots ``first_slot, first_slot + 1, ...`` (wrapping).

        Cost: one contiguous copy per column (two where the range wraps).
        """
        n = next(iter(columns.values())).shape[0]
        for snapshot in self._snapshots:
            snapshot.before_write(first_slot, n)
        head = min(n, self.capacity - first_slot)
        for key, dest in self._views.items():
            src = _numpy_view(columns[key].detach())
            np.copyto(dest[first_slot : first_slot + head], src[:head])
            if head < n:
                np.copyto(dest[: n - head], src[head:])

    def gather(
        self, slots: np.ndarray, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Copy the rows at ``slots`` (integers, any shape ``S``) into tensors ``[*S, ...]``.

        Args:
            slots: the slots to read.
            out: optional destination per key (contiguous, shaped ``[*S, ...]``,
                the column's dtype), e.g. a shared-memory or pinned staging
                buffer; new tensors are allocated for keys it lacks.

        Cost: one ``np.take`` per column, O(rows gathered * row bytes).
        """
        flat = slots.reshape(-1)
        result = {}
        for key, col in self.columns.items():
            view = self._views[key]
            dest = None if out is None else out.get(key)
            if dest is not None:
                _take(view, flat, _numpy_view(dest).reshape(flat.shape[0], *col.shape[1:]))
                result[key] = dest
                continue
            rows_np = np.empty((flat.shape[0], *view.shape[1:]), dtype=view.dtype)
            _take(view, flat, rows_np)
            rows = torch.from_numpy(rows_np)
            if rows.dtype != col.dtype:
                rows = rows.view(col.dtype)
            result[key] = rows if slots.ndim == 1 else rows.reshape(*slots.shape, *col.shape[1:])
        return result

    @property
    def views(self) -> dict[str, np.ndarray]:
        """Numpy views of the whole columns (bfloat16 as int16), e.g. to read a checkpoint into."""
        return dict(self._views)

    def snapshot(
        self, lock: threading.Lock, next_slot: int, used: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> StorageSnapshot:
        """Begin a :class:`~replay_server.engine.snapshot.StorageSnapshot` of slots ``0 .. used - 1``.

        Call under the owning table's ``lock`` (which the snapshot takes to
        read); ``next_slot`` is the slot the next insert writes. O(1).
        """
        dtypes = {key: spec.dtype for key, spec in self.schema.items()}
        snapshot = StorageSnapshot(self._views, dtypes, lock, next_slot, used,
                                   self.schema.row_bytes, chunk_bytes,
                                   on_close=self._snapshots.remove)
        self._snapshots.append(snapshot)
        return snapshot

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, view in self._views.items():
            saved = _numpy_view(state[key].detach())
            np.copyto(view[: saved.shape[0]], saved)


_PARALLEL_BYTES = 2 << 20  # gathers at least this large are split across threads
_GATHER_THREADS = max(1, min(4, os.cpu_count() or 1))
_gather_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _take(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[rows]``; large gathers run on several threads (numpy releases the GIL).

    A 7 MB gather of Atari rows is memory-latency bound on one core: two
    threads make it about 1.5x faster on a 2-core machine. ``mode="clip"``:
    with an ``out`` and the default ``mode="raise"`` numpy gathers into a
    temporary and copies it over (to leave ``out`` untouched on a bad index);
    slots come from the table's own ring, never out of range.
    """
    global _gather_pool
    nbytes = out.nbytes
    parts = min(_GATHER_THREADS, len(rows), nbytes // (_PARALLEL_BYTES // 2))
    if parts < 2 or nbytes < _PARALLEL_BYTES:
        np.take(src, rows, axis=0, out=out, mode="clip")
        return
    if _gather_pool is None:
        with _pool_lock:
            if _gather_pool is None:
                _gather_pool = ThreadPoolExecutor(_GATHER_THREADS - 1,
                                                  thread_name_prefix="replay-gather")
    bounds = np.linspace(0, len(rows), parts + 1).astype(int)
    futures = [_gather_pool.submit(np.take, src, rows[a:b], 0, out[a:b], "clip")
               for a, b in zip(bounds[1:-1], bounds[2:])]
    np.take(src, rows[: bounds[1]], axis=0, out=out[: bounds[1]], mode="clip")
    for future in futures:
        future.result()


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory (bfloat16 viewed as int16)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()

