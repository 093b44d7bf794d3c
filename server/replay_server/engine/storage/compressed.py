"""Per-column compression of stored rows (lz4), decompressed in parallel on gather.

A table with ``compress_keys = ["obs"]`` keeps each row of those columns as
one lz4 block (``lz4.block``, compressed when the row is written); its other
columns are plain preallocated tensors as in
:class:`~replay_server.engine.storage.memory.ColumnStorage`, which this
extends (writes, gathers, snapshots and loads go through the same paths; a
compressed column presents itself to them as a :class:`CompressedColumn`,
whose slices read and write decompressed rows). Gathers decompress the
sampled rows straight into the batch, split across the worker pool (lz4
releases the GIL). ``info`` shows the compression ratio (raw bytes over
stored bytes of the rows present) in ``sampler_stats["compression_ratio"]``.

Memory: the compressed bytes, plus about 41 bytes per row (a Python bytes
object and its list slot). The memory ledger promises the worst case (a
row lz4 cannot shrink: its raw size, lz4's bound, and that overhead), so
the check made when the schema is fixed stays true whatever the data; what
compression saves is memory the server then does not touch.

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lz4.block
import numpy as np
import torch

from replay_server.engine import workers
from replay_server.engine.schema import Schema
from replay_server.engine.storage.memory import ColumnStorage, _numpy_view
from replay_server.errors import InsufficientMemoryError

ROW_OVERHEAD = 41
"""Bytes a compressed row costs beyond its compressed bytes (a bytes object, a list slot)."""

_PARALLEL_BYTES = 1 << 20
"""Gathers of at least this many raw bytes decompress on several threads."""


class CompressedColumn:
    """``capacity`` rows of one column, each an lz4 block; sliced like a numpy array.

    ``column[a:b]`` is a new array of the decompressed rows (zeros where none
    was written); ``column[a:b] = rows`` compresses and stores them.
    """

    def __init__(self, capacity: int, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape = (capacity, *row_shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.ndim = len(self.shape)
        self.row_bytes = self.itemsize * int(np.prod(row_shape, dtype=np.int64))
        self._blobs: list[bytes | None] = [None] * capacity
        self.stored_bytes = 0
        self.rows = 0

    def __getitem__(self, index: slice) -> np.ndarray:
        slots = np.arange(*index.indices(self.shape[0]))
        out = np.empty((slots.size, *self.shape[1:]), dtype=self.dtype)
        self.read(slots, out)
        return out

    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        self.write(np.arange(*index.indices(self.shape[0])), rows)

    def write(self, slots: Iterable[int], rows: np.ndarray) -> None:
        """Compress ``rows`` (``[n, *row_shape]``) into ``slots``."""
        blobs = self._blobs
        for slot, row in zip(slots, np.ascontiguousarray(rows).reshape(len(rows), -1)):
            old = blobs[slot]
            if old is None:
                self.rows += 1
            else:
                self.stored_bytes -= len(old)
            blob = lz4.block.compress(row, store_size=False)
            blobs[slot] = blob
            self.stored_bytes += len(blob)

    def read(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Decompress the rows at ``slots`` into ``out`` (``[n, *row_shape]``, contiguous)."""
        flat = out.reshape(len(slots), -1).view(np.uint8)
        blobs, size = self._blobs, self.row_bytes
        for i, slot in enumerate(slots.tolist()):
            blob = blobs[slot]
            if blob is None:
                flat[i] = 0
            else:
                flat[i] = np.frombuffer(lz4.block.decompress(blob, uncompressed_size=size),
                                        dtype=np.uint8)

    def clear(self) -> None:
        self._blobs = [None] * self.shape[0]
        self.stored_bytes = self.rows = 0


class CompressedStorage(ColumnStorage):
    """Columns for ``capacity`` rows of ``schema``, those named by ``keys`` compressed.

    Raises:
        InsufficientMemoryError: the plain columns could not be allocated.
    """

    kind = "compressed"

    def __init__(self, schema: Schema, capacity: int, keys: Iterable[str]) -> None:
        self.schema = schema
        self.capacity = capacity
        self.pinned = False
        self.compressed = tuple(keys)
        try:
            plain = {key: torch.empty((capacity, *spec.shape), dtype=spec.dtype)
                     for key, spec in schema.items() if key not in self.compressed}
        except (MemoryError, RuntimeError) as exc:
            raise InsufficientMemoryError(f"cannot allocate the uncompressed columns of "
                                          f"{capacity:,} rows of {schema.describe()}: {exc}") from None
        self._adopt(plain, None)
        self._packed = {key: CompressedColumn(capacity, schema[key].shape,
                                              _numpy_view(torch.empty(0, dtype=schema[key].dtype)).dtype)
                        for key in self.compressed}
        self._views = {key: self._packed.get(key, self._views.get(key)) for key in schema}
        self._dtypes = {key: spec.dtype for key, spec in schema.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held now: the plain columns, and the compressed rows with their overhead."""
        plain = sum(t.numel() * t.element_size() for t in self.columns.values())
        return plain + sum(c.stored_bytes + ROW_OVERHEAD * c.rows for c in self._packed.values())

    def write(self, first_slot: int, columns: Mapping[str, torch.Tensor]) -> None:
        n = next(iter(columns.values())).shape[0]
        for snapshot in self._snapshots:
            snapshot.before_write(first_slot, n)
        slots = (first_slot + np.arange(n)) % self.capacity
        for key, view in self._views.items():
            src = _numpy_view(columns[key].detach())
            if isinstance(view, CompressedColumn):
                view.write(slots.tolist(), src)
            else:
                head = min(n, self.capacity - first_slot)
                np.copyto(view[first_slot : first_slot + head], src[:head])
                if head < n:
                    np.copyto(view[: n - head], src[head:])

    def gather(
        self, slots: np.ndarray, out: Mapping[str, torch.Tensor] | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        flat = slots.reshape(-1)
        wanted = list(self.schema) if keys is None else list(keys)
        result = super().gather(slots, out, keys=[k for k in wanted if k in self.columns])
        for key in wanted:
            column = self._packed.get(key)
            if column is None:
                continue
            dtype = self._dtypes[key]
            dest = None if out is None else out.get(key)
            if dest is None:
                dest = torch.empty((*slots.shape, *column.shape[1:]), dtype=dtype)
            target = _numpy_view(dest).reshape(flat.size, *column.shape[1:])
            parts = min(workers.THREADS, max(1, flat.size * column.row_bytes // _PARALLEL_BYTES))
            if parts < 2:
                column.read(flat, target)
            else:
                bounds = np.linspace(0, flat.size, parts + 1).astype(int)
                tasks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
                workers.run_split(lambda t, c=column: c.read(flat[t[0]:t[1]], target[t[0]:t[1]]),
                                  tasks, len(tasks))
            result[key] = dest
        return result

    def stats(self) -> dict[str, Any]:
        raw = sum(c.rows * c.row_bytes for c in self._packed.values())
        stored = sum(c.stored_bytes for c in self._packed.values())
        return {"compression_ratio": raw / stored if stored else 1.0}

    def load_views(self) -> dict[str, np.ndarray]:
        """Arrays a checkpoint's rows are read into: the plain columns themselves, and a
        staging array per compressed column (the raw size, until :meth:`loaded`)."""
        return {key: np.empty(view.shape, dtype=view.dtype)
                if isinstance(view, CompressedColumn) else view
                for key, view in self._views.items()}

    def loaded(self, views: Mapping[str, np.ndarray]) -> None:
        """Compress the staged rows of :meth:`load_views` (all ``capacity`` slots)."""
        for key, column in self._packed.items():
            column[:] = views[key]

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, view in self._views.items():
            saved = _numpy_view(state[key].detach())
            view[: saved.shape[0]] = saved
