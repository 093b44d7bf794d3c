"""One column's rows in one backend: the interface every storage backend implements.

A table's storage is a set of columns, one per flat key
(:class:`~replay_server.engine.storage.columns.ColumnStorage`), and each
column is kept by its own backend: in RAM (pinned or not), in a
memory-mapped file, in a device's memory, or lz4-compressed over RAM or a
file. A :class:`Column` holds ``capacity`` rows of one
:class:`~replay_server.engine.schema.FieldSpec` and answers four things:

* ``write(first_slot, rows)``: store rows at consecutive slots (wrapping);
* ``take(slots, into)``: copy the rows at ``slots`` into a tensor;
* ``column[a:b]`` / ``column[a:b] = rows``: host arrays of whole slot
  ranges, which is how snapshots read a column and restores fill it (see
  :mod:`replay_server.engine.snapshot`); a plain numpy backend hands out its
  own array (:attr:`Column.view`), the others an object sliced the same way;
* ``nbytes``: bytes it holds now.

Each backend declares what a column of it costs: bytes of the process's
memory (:meth:`Column.ram_bytes`, what the memory ledger promises), of a
device's, and of disk.

Copies go through numpy views of the memory: ``np.take`` and ``np.copyto``
are single-threaded memcpy loops, several times faster than torch's indexing
for row gathers and immune to OpenMP threads spinning on a busy machine
(bfloat16, which numpy lacks, travels as same-width int16: ``replay_proto.dtypes``).

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from replay_proto.dtypes import numpy_dtype, numpy_view, tensor_view
from replay_server.engine import buffers, workers
from replay_server.engine.schema import FieldSpec
from replay_server.engine.workers import take_rows

__all__ = ["ArrayColumn", "Column", "Region", "copy_rows", "take_rows"]


HOST = torch.device("cpu")
"""The host, one object for every host column (compared by identity on the hot path)."""

Region = tuple[Sequence[tuple["Column", np.ndarray]], torch.Tensor]
"""``(parts, into)``: rows of several columns read into one destination, row by row:
``into[i, j]`` is the row at ``parts[j]``'s ``slots[i]`` of its column (e.g. a frame stack,
three frames of one column and the newest of another)."""


class Column(ABC):
    """``capacity`` rows of one column, in one backend (see the module docstring).

    Attributes:
        spec: the column's dtype and per-row shape.
        capacity: rows it holds.
        shape: ``(capacity, *spec.shape)``.
        dtype: the numpy dtype its host arrays have (bfloat16 as int16).
        device: where :meth:`take` writes without a copy (``cpu`` for host backends).
    """

    kind: ClassVar[str]
    """The backend's name (``column_storage`` values and ``info``)."""

    quick_writes: ClassVar[bool] = False
    """Whether a write of a few rows is a plain copy into memory that is there (no disk, no
    device, no arena to compact): what :meth:`ColumnStorage.quick_writes` asks."""

    def __init__(self, spec: FieldSpec, capacity: int) -> None:
        self.spec = spec
        self.capacity = capacity
        self.shape = (capacity, *spec.shape)
        self.dtype = numpy_dtype(spec.dtype)
        self.itemsize = self.dtype.itemsize
        self.ndim = len(self.shape)
        self.row_bytes = spec.row_bytes
        self.device = HOST

    @staticmethod
    def ram_bytes(spec: FieldSpec, capacity: int) -> int:
        """Bytes of this process's memory a column of ``capacity`` rows is promised."""
        return capacity * spec.row_bytes

    @property
    def pinned(self) -> bool:
        """Whether its memory is page-locked."""
        return False

    @property
    def allocated(self) -> bool:
        """Whether it holds its memory yet (a device column allocates on first use)."""
        return True

    @property
    def view(self) -> Any:
        """What snapshots slice (a numpy array of the whole column, or this column)."""
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self.capacity * self.row_bytes

    def prepare(self) -> None:
        """Get ready for the first write (a device column allocates here)."""

    def encode(self, rows: torch.Tensor) -> Any:
        """What :meth:`write` stores for ``rows``, made without the table's lock (a codec
        compresses here); ``rows`` as they are for a plain backend."""
        return rows

    def reserve(self, first_slot: int, encoded: Any) -> None:
        """Make sure ``encoded`` fits at ``first_slot`` now (raise before anything changed),
        e.g. reserve disk or promise memory."""

    @abstractmethod
    def write(self, first_slot: int, encoded: Any) -> None:
        """Store ``encoded`` rows (of :meth:`encode`) at slots ``first_slot, ...`` (wrapping)."""

    @abstractmethod
    def take(self, slots: np.ndarray, into: torch.Tensor) -> None:
        """``into[i] = row at slots[i]``: ``slots`` flat int64, ``into`` ``[n, *spec.shape]``
        contiguous on :attr:`device`."""

    def take_regions(self, regions: Sequence[Region]) -> bool:
        """For every region ``(parts, into)``: ``into[i, j] = row at parts[j]'s slots[i] of
        parts[j]'s column`` (``into`` ``[n, len(parts), *spec.shape]`` contiguous), in one
        pass where the backend has one, each distinct stored row read once however many
        places want it; ``False`` (the default): the caller takes part by part."""
        return False

    def gather(self, slots: np.ndarray, device: torch.device) -> torch.Tensor:
        """A new tensor ``[n, *spec.shape]`` on ``device`` of the rows at ``slots`` (flat)."""
        into = buffers.empty((slots.size, *self.spec.shape), self.spec.dtype, device)
        self.take(slots, into)
        return into

    @abstractmethod
    def __getitem__(self, index: slice) -> np.ndarray:
        """Host copy of the rows of a slot range."""

    @abstractmethod
    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        """Store host rows into a slot range (restores)."""

    def load_view(self) -> Any:
        """What a checkpoint's rows are read into (sliced like :attr:`view`)."""
        return self.view

    def stats(self) -> dict[str, Any]:
        """Backend figures for ``info`` (none by default)."""
        return {}


class ArrayColumn(Column):
    """A column that is one numpy array ``[capacity, ...]`` on the host (RAM or a file)."""

    array: np.ndarray

    def __init__(self, spec: FieldSpec, capacity: int) -> None:
        super().__init__(spec, capacity)
        self._row_shape = tuple(spec.shape)

    @property
    def view(self) -> np.ndarray:
        return self.array

    def write(self, first_slot: int, encoded: Any) -> None:
        copy_rows(self.array, first_slot, numpy_view(encoded.detach()))

    def take(self, slots: np.ndarray, into: torch.Tensor) -> None:
        self._take(slots, numpy_view(into))

    def _take(self, slots: np.ndarray, out: np.ndarray) -> None:
        take_rows(self.array, slots, out)

    def gather(self, slots: np.ndarray, device: torch.device) -> torch.Tensor:
        """Through numpy (its allocation is cheaper than torch's for a batch)."""
        if device.type != "cpu":
            return super().gather(slots, device)
        rows = np.empty((slots.size, *self._row_shape), dtype=self.dtype)
        self._take(slots, rows)
        return tensor_view(rows, self.spec.dtype)

    def __getitem__(self, index: slice) -> np.ndarray:
        return self.array[index]

    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        self.array[index] = rows


PARALLEL_BYTES = workers.PARALLEL_BYTES
"""Writes at least this large are split across the worker pool (gathers: :mod:`workers`)."""

WRITE_THREADS = workers.THREADS if workers.MANY_CORES else 1
"""Writes go parallel from 4 cores on. A write is bandwidth-bound (and, into fresh
storage, bound by the kernel zeroing pages), and on 2 busy cores a second
thread measured slower (15-33M rows/s against 30-33M for 100,000-row inserts);
a gather is latency-bound, so two threads help even there."""


def pieces(nbytes: int, rows: int, threads: int) -> int:
    """How many of ``threads`` a copy of ``nbytes`` in ``rows`` rows is worth (1: this one)."""
    if nbytes < PARALLEL_BYTES:
        return 1
    return max(1, min(threads, rows, nbytes // (PARALLEL_BYTES // 2)))


def copy_rows(dest: np.ndarray, first_slot: int, src: np.ndarray) -> None:
    """``dest[first_slot:first_slot + n] = src`` wrapping at the end of ``dest``; a large
    copy split by rows across threads (see :data:`WRITE_THREADS`)."""
    n, capacity = src.shape[0], dest.shape[0]
    head = min(n, capacity - first_slot)
    pairs = [(dest[first_slot:first_slot + head], src[:head])]
    if head < n:
        pairs.append((dest[: n - head], src[head:]))
    parts = pieces(src.nbytes, n, WRITE_THREADS)
    if parts < 2:
        for d, s in pairs:
            np.copyto(d, s)
        return
    tasks = []
    for d, s in pairs:
        share = max(1, round(parts * d.shape[0] / n))
        bounds = np.linspace(0, d.shape[0], share + 1).astype(int)
        tasks += [(d[a:b], s[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    workers.run_split(lambda task: np.copyto(*task), tasks, parts)
