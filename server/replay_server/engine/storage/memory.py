"""Column-wise row storage in RAM: one preallocated tensor per flat key.

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

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_server.engine import workers
from replay_server.engine.prefault import Prefaulter
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
            columns = {
                key: torch.empty((capacity, *spec.shape), dtype=spec.dtype, pin_memory=pin_memory)
                for key, spec in schema.items()
            }
        except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as either
            raise InsufficientMemoryError(
                f"cannot allocate {capacity * schema.row_bytes:,} bytes of storage for "
                f"{capacity:,} rows of {schema.describe()}: {exc}") from None
        # Pinned memory is resident from the start; pageable storage is backed as rows arrive.
        self._adopt(columns, None if pin_memory else Prefaulter(capacity, schema.row_bytes))

    def _adopt(self, columns: dict[str, torch.Tensor], prefaulter: Prefaulter | None) -> None:
        """Use ``columns`` (``[capacity, ...]`` each) as the storage's memory."""
        self.columns: dict[str, torch.Tensor] = columns
        self._views = {key: _numpy_view(col) for key, col in columns.items()}
        self._snapshots: list[StorageSnapshot] = []
        self._prefaulter = prefaulter

    @property
    def nbytes(self) -> int:
        """Bytes allocated for all columns."""
        return self.capacity * self.schema.row_bytes

    def write(self, first_slot: int, columns: Mapping[str, torch.Tensor]) -> None:
        """Write ``n`` rows at slots ``first_slot, first_slot + 1, ...`` (wrapping).

        Cost: one contiguous copy per column (two where the range wraps); on 4
        or more cores a write of :data:`_PARALLEL_BYTES` or more is split
        across threads (see :data:`_WRITE_THREADS`).
        While the table fills, the pages after the write are made resident in
        the background (:mod:`~replay_server.engine.prefault`).
        """
        n = next(iter(columns.values())).shape[0]
        for snapshot in self._snapshots:
            snapshot.before_write(first_slot, n)
        head = min(n, self.capacity - first_slot)
        pairs = []
        for key, dest in self._views.items():
            src = _numpy_view(columns[key].detach())
            pairs.append((dest[first_slot : first_slot + head], src[:head]))
            if head < n:
                pairs.append((dest[: n - head], src[head:]))
        _copy(pairs, n * self.schema.row_bytes)
        if self._prefaulter is not None:
            self._prefaulter.advance(self._views.values(), (first_slot + n) % self.capacity)

    kind = "memory"
    """The table option that selects this storage (``storage = "memory"``)."""

    def gather(
        self, slots: np.ndarray, out: Mapping[str, torch.Tensor] | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy the rows at ``slots`` (integers, any shape ``S``) into tensors ``[*S, ...]``.

        Args:
            slots: the slots to read.
            out: optional destination per key (contiguous, shaped ``[*S, ...]``,
                the column's dtype), e.g. a shared-memory or pinned staging
                buffer; new tensors are allocated for keys it lacks.
            keys: the columns to read (default: all).

        Cost: one ``np.take`` per column, O(rows gathered * row bytes).
        """
        flat = slots.reshape(-1)
        result = {}
        for key in self.columns if keys is None else keys:
            col = self.columns[key]
            view = self._views[key]
            dest = None if out is None else out.get(key)
            if dest is not None:
                self._take(view, flat, _numpy_view(dest).reshape(flat.shape[0], *col.shape[1:]))
                result[key] = dest
                continue
            rows_np = np.empty((flat.shape[0], *view.shape[1:]), dtype=view.dtype)
            self._take(view, flat, rows_np)
            rows = torch.from_numpy(rows_np)
            if rows.dtype != col.dtype:
                rows = rows.view(col.dtype)
            result[key] = rows if slots.ndim == 1 else rows.reshape(*slots.shape, *col.shape[1:])
        return result

    def prepare(self) -> None:
        """Get ready for the first write (here: nothing; a device storage allocates)."""

    def place(self, batch: SampleBatch, out: Mapping[str, torch.Tensor] | None) -> SampleBatch:
        """The sampled ``batch`` where this storage hands batches out (here: as it is, on the host)."""
        return batch

    def _take(self, view: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[:] = view[rows]`` (a storage kind may read in another order)."""
        _take(view, rows, out)

    def stats(self) -> dict[str, Any]:
        """Storage figures for ``info`` (none here)."""
        return {}

    def load_views(self) -> dict[str, np.ndarray]:
        """Arrays a checkpoint's rows are read into (then call :meth:`loaded`): the columns' views."""
        return self.views

    def loaded(self, views: Mapping[str, np.ndarray]) -> None:
        """The rows of :meth:`load_views` were read (nothing to do here)."""

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


_PARALLEL_BYTES = 2 << 20  # copies at least this large are split across threads
_THREADS = workers.THREADS
_WRITE_THREADS = _THREADS if workers.MANY_CORES else 1
"""Writes go parallel from 4 cores on. A write is bandwidth-bound (and, into fresh
storage, bound by the kernel zeroing pages), and on 2 busy cores a second
thread measured slower (15-33M rows/s against 30-33M for 100,000-row inserts);
a gather is latency-bound, so two threads help even there."""


def _pieces(nbytes: int, rows: int, threads: int) -> int:
    """How many of ``threads`` a copy of ``nbytes`` in ``rows`` rows is worth (1: this one)."""
    if nbytes < _PARALLEL_BYTES:
        return 1
    return max(1, min(threads, rows, nbytes // (_PARALLEL_BYTES // 2)))


def _copy(pairs: list[tuple[np.ndarray, np.ndarray]], nbytes: int) -> None:
    """``dest[:] = src`` for each pair (same leading dim); large copies split by rows across threads."""
    rows = sum(dest.shape[0] for dest, _ in pairs)
    parts = _pieces(nbytes, rows, _WRITE_THREADS)
    if parts < 2:
        for dest, src in pairs:
            np.copyto(dest, src)
        return
    tasks = []
    for dest, src in pairs:
        share = max(1, round(parts * dest.shape[0] / rows))
        bounds = np.linspace(0, dest.shape[0], share + 1).astype(int)
        tasks += [(dest[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    workers.run_split(lambda task: np.copyto(*task), tasks, parts)


def _take(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[rows]``; large gathers run on several threads (numpy releases the GIL).

    A 7 MB gather of Atari rows is memory-latency bound on one core: two
    threads make it about 1.5x faster on a 2-core machine. ``mode="clip"``:
    with an ``out`` and the default ``mode="raise"`` numpy gathers into a
    temporary and copies it over (to leave ``out`` untouched on a bad index);
    slots come from the table's own ring, never out of range.
    """
    parts = _pieces(out.nbytes, len(rows), _THREADS)
    if parts < 2:
        np.take(src, rows, axis=0, out=out, mode="clip")
        return
    bounds = np.linspace(0, len(rows), parts + 1).astype(int)
    tasks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    workers.run_split(lambda t: np.take(src, rows[t[0]:t[1]], axis=0, out=out[t[0]:t[1]], mode="clip"),
               tasks, parts)


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory (bfloat16 viewed as int16)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()

