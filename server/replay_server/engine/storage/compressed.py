"""The lz4 codec: a column's rows compressed, over RAM or a memory-mapped file.

A column named in ``compress_keys`` keeps each row as one lz4 block
(``lz4.block``), compressed before the table takes its lock and
decompressed on gather straight into the batch, split across the worker
pool (lz4 releases the GIL). The blocks live in a
:class:`~replay_server.engine.storage.arena.ByteArena`: in RAM, or, for a
column whose backend is ``memmap``, in a sparse file reserved a segment at a
time. The codec sits over either backend, and beside any other column's:
a table can compress ``obs`` on disk and keep ``action`` plain in RAM.
``info`` shows the compression ratio (raw bytes over stored bytes of the
rows present) in ``sampler_stats["compression_ratio"]``.

Memory: the segments holding the blocks (promised to the memory ledger as
they are first taken, in RAM; reserved on disk, in a file) and 12 bytes per
slot. Snapshots and restores see decompressed rows (``column[a:b]``), so a
checkpoint's format does not depend on compression.

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lz4.block
import numpy as np
import torch

from replay_server.engine import workers
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage.arena import ByteArena
from replay_server.engine.storage.base import Column, numpy_view
from replay_server.engine.storage.memmap import MappedFile

_PARALLEL_BYTES = 1 << 20
"""Gathers of at least this many raw bytes decompress on several threads."""


def bound(row_bytes: int) -> int:
    """The most bytes lz4 can make of ``row_bytes`` (its ``LZ4_compressBound``)."""
    return row_bytes + row_bytes // 255 + 16


class Lz4Column(Column):
    """``capacity`` rows of ``spec``, each an lz4 block in an arena (see the module).

    Args:
        spec: the column's dtype and per-row shape.
        capacity: rows.
        file: the sparse file its arena lives in (a ``memmap`` column), or ``None``: RAM.
        grow: (RAM) called with the bytes of segments taken before a new one is;
            raises to refuse the write.
    """

    kind = "lz4"

    def __init__(self, spec: FieldSpec, capacity: int, file: MappedFile | None = None,
                 grow: Callable[[int], None] | None = None) -> None:
        super().__init__(spec, capacity)
        self.backend = "memory" if file is None else "memmap"
        self.arena = ByteArena(capacity, bound(spec.row_bytes), file, grow)

    @staticmethod
    def ram_bytes(spec: FieldSpec, capacity: int) -> int:
        """The per-slot offsets; the segments are promised as they are taken."""
        return 12 * capacity

    @staticmethod
    def file_bytes(spec: FieldSpec, capacity: int) -> int:
        """The address range of a column's file (sparse: reserved a segment at a time)."""
        return ByteArena.file_bytes(capacity, bound(spec.row_bytes))

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def encode(self, rows: torch.Tensor) -> list[bytes]:
        flat = np.ascontiguousarray(numpy_view(rows.detach().cpu())).reshape(len(rows), -1)
        return [lz4.block.compress(row, store_size=False) for row in flat]

    def reserve(self, first_slot: int, encoded: list[bytes]) -> None:
        slots = (first_slot + np.arange(len(encoded))) % self.capacity
        self.arena.reserve([len(b) for b in encoded], slots)

    def write(self, first_slot: int, encoded: list[bytes]) -> None:
        slots = ((first_slot + np.arange(len(encoded))) % self.capacity).tolist()
        self.arena.write(slots, encoded)

    def take(self, slots: np.ndarray, into: torch.Tensor) -> None:
        target = numpy_view(into).reshape(slots.size, -1)
        parts = min(workers.THREADS, max(1, slots.size * self.row_bytes // _PARALLEL_BYTES))
        if parts < 2:
            self._read(slots, target)
            return
        bounds = np.linspace(0, slots.size, parts + 1).astype(int)
        tasks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        workers.run_split(lambda t: self._read(slots[t[0]:t[1]], target[t[0]:t[1]]),
                          tasks, len(tasks))

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Decompress the rows at ``slots`` into ``out`` (``[n, row values]``, contiguous;
        zeros where none was written). Memoryviews all the way: per row one decompress
        and one copy, and little else holding the GIL (the other threads decompress)."""
        size = self.row_bytes
        buffer, decompress = self.arena.view, lz4.block.decompress
        offsets = self.arena.offsets[slots].tolist()
        lengths = self.arena.lengths[slots].tolist()
        if not out.flags.c_contiguous:  # e.g. the last frame of each stack: row by row
            for i, (offset, length) in enumerate(zip(offsets, lengths)):
                out[i] = 0 if offset < 0 else np.frombuffer(
                    decompress(buffer[offset:offset + length], uncompressed_size=size),
                    dtype=out.dtype)
            return
        flat = memoryview(out).cast("B")
        at = 0
        for offset, length in zip(offsets, lengths):
            if offset < 0:
                flat[at:at + size] = bytes(size)
            else:
                flat[at:at + size] = decompress(buffer[offset:offset + length],
                                                uncompressed_size=size)
            at += size

    def __getitem__(self, index: slice) -> np.ndarray:
        slots = np.arange(*index.indices(self.capacity))
        out = np.empty((slots.size, *self.spec.shape), dtype=self.dtype)
        self._read(slots, out.reshape(slots.size, -1))
        return out

    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        slots = np.arange(*index.indices(self.capacity))
        flat = np.ascontiguousarray(rows).reshape(slots.size, -1)
        blocks = [lz4.block.compress(row, store_size=False) for row in flat]
        self.arena.reserve([len(b) for b in blocks], slots)
        self.arena.write(slots.tolist(), blocks)

    def stats(self) -> dict[str, Any]:
        arena = self.arena
        return {"raw_bytes": arena.blocks * self.row_bytes, "stored_bytes": arena.stored}
