"""The lz4 codec: a column's rows compressed, over RAM or a memory-mapped file.

A column named in ``compress_keys`` keeps each row as one lz4 block
(``lz4.block``, behind its 4-byte size), compressed before the table takes
its lock and decompressed on gather straight into the batch: a batch's
blocks in one call outside the GIL
(:mod:`~replay_server.engine.storage.lz4_batch`), a large batch in parts
across the worker pool. The blocks live in a
:class:`~replay_server.engine.storage.arena.ByteArena`: in RAM, or, for a
column whose backend is ``memmap``, in a sparse file reserved a segment at a
time. The codec sits over either backend, and beside any other column's:
a table can compress ``obs`` on disk and keep ``action`` plain in RAM.
``info`` shows the compression ratio (raw bytes over stored bytes of the
rows present) in ``sampler_stats["compression_ratio"]``.

Memory: the segments holding the blocks (promised to the memory ledger as
they are first taken, in RAM; reserved on disk, in a file), 4 bytes per
block (its size) and 12 bytes per slot. Snapshots and restores see decompressed rows (``column[a:b]``), so a
checkpoint's format does not depend on compression.

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lz4.block
import numpy as np
import torch

from replay_proto.dtypes import numpy_view
from replay_server.engine import workers
from replay_server.engine.schema import FieldSpec
from replay_server.engine.slot_memory import COMPRESSED_SLOT_BYTES
from replay_server.engine.storage.arena import ByteArena
from replay_server.engine.storage.base import Column, Region
from replay_server.engine.storage.lz4_batch import (
    DECODER, PREFIX, prefixed, stand_in, zero_block)
from replay_server.engine.storage.memmap import MappedFile

_PARALLEL_BYTES = 1 << 20
"""Gathers of at least this many raw bytes decompress on several threads."""

_COLUMN_SHIFT = 40
"""A (column, slot) pair as one int64: ``column << _COLUMN_SHIFT | slot`` (slots < 2**40)."""

_SLOT_MASK = (1 << _COLUMN_SHIFT) - 1

_JOINED_BLOCK = 256
"""Gathers whose stored blocks are all at most this many bytes (compressed small rows)
join them by numpy's gather (:meth:`ByteArena.joined`), not a slice per block: at 74
bytes 4x cheaper; at Atari frames' 600 bytes and more, 9x dearer."""


def bound(row_bytes: int) -> int:
    """The most bytes lz4 can make of ``row_bytes`` (its ``LZ4_compressBound``)."""
    return row_bytes + row_bytes // 255 + 16


def stored_bound(row_bytes: int) -> int:
    """The most bytes a row of ``row_bytes`` takes in the arena (its block and the block's size)."""
    return PREFIX + bound(row_bytes)


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
        self.arena = ByteArena(capacity, stored_bound(spec.row_bytes), file, grow)
        self._decoder = DECODER if DECODER is not None and DECODER.fits(
            spec.row_bytes, bound(spec.row_bytes)) else None
        self._header = b"" if self._decoder is None else self._decoder.header(
            bound(spec.row_bytes))
        self._zeros = zero_block(spec.row_bytes)
        self._stand_in = stand_in(spec.row_bytes)

    @staticmethod
    def ram_bytes(spec: FieldSpec, capacity: int) -> int:
        """The per-slot offsets; the segments are promised as they are taken."""
        return COMPRESSED_SLOT_BYTES * capacity

    @staticmethod
    def file_bytes(spec: FieldSpec, capacity: int) -> int:
        """The address range of a column's file (sparse: reserved a segment at a time)."""
        return ByteArena.file_bytes(capacity, stored_bound(spec.row_bytes))

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def encode(self, rows: torch.Tensor) -> list[bytes]:
        flat = np.ascontiguousarray(numpy_view(rows.detach().cpu())).reshape(len(rows), -1)
        return [prefixed(lz4.block.compress(row, store_size=False)) for row in flat]

    def reserve(self, first_slot: int, encoded: list[bytes]) -> None:
        slots = (first_slot + np.arange(len(encoded))) % self.capacity
        self.arena.reserve([len(b) for b in encoded], slots)

    def write(self, first_slot: int, encoded: list[bytes]) -> None:
        slots = ((first_slot + np.arange(len(encoded))) % self.capacity).tolist()
        self.arena.write(slots, encoded)

    def take(self, slots: np.ndarray, into: torch.Tensor) -> None:
        target = numpy_view(into).reshape(slots.size, -1)
        if self._decoder is None:
            self._split(slots.size, lambda a, b: self._read_blocks(slots[a:b], target[a:b]))
            return
        joined = self.arena.joined(slots, _JOINED_BLOCK)
        if joined is None:
            self._decode(self._blocks(slots), target)
        else:
            self._decode_joined(*joined, target)

    def take_regions(self, regions: Sequence[Region]) -> bool:
        """Decode every region's rows straight into its destination (all lz4 columns of one
        spec, as a frame-stacked key and its ``next.`` key are), each distinct stored row
        once.

        The first place that wants a row (in the regions' order, row by row) gets it
        decoded; every other place gets a stand-in block (a row of zeros, a few bytes
        that decode at memset speed) and then a copy of the first. All the regions'
        blocks decode in one job, in parts across the worker pool (outside the GIL).
        ``False`` where a column or destination does not allow it (the caller takes part
        by part).

        Cost: a sort of the regions' (column, slot) pairs, one decode per distinct stored
        row, one copy per repeat.
        """
        columns = [column for parts, _ in regions for column, _ in parts]
        if self._decoder is None or not all(
                into.is_contiguous() and into.device.type == "cpu" for _, into in regions) \
                or not all(isinstance(c, Lz4Column) and c._decoder is not None
                           and c.spec == self.spec for c in columns):
            return False
        distinct = list(dict.fromkeys(columns))
        number = {id(column): k for k, column in enumerate(distinct)}
        keys, outs = [], []
        for parts, into in regions:  # (column, slot) of every place, row by row
            key = np.empty((parts[0][1].size, len(parts)), dtype=np.int64)
            for j, (column, slots) in enumerate(parts):
                key[:, j] = slots + (number[id(column)] << _COLUMN_SHIFT)
            keys.append(key.reshape(-1))
            outs.append(numpy_view(into).reshape(key.size, -1))
        every = np.concatenate(keys)
        rows, first, inverse = np.unique(every, return_index=True, return_inverse=True)
        blocks = np.empty(every.size, dtype=object)
        blocks.fill(self._stand_in)  # (np.full would take it for a string: trailing zeros go)
        cuts = np.searchsorted(rows, np.arange(1, len(distinct)) << _COLUMN_SHIFT).tolist()
        for column, wanted, at in zip(distinct, np.split(rows, cuts), np.split(first, cuts)):
            mine = column._blocks(wanted & _SLOT_MASK)  # type: ignore[attr-defined]
            blocks[at] = np.fromiter(mine, dtype=object, count=len(mine))  # views, as they are
        self._decode_regions(blocks, outs)
        home = first[inverse.reshape(-1)]
        repeats = np.flatnonzero(home != np.arange(every.size))
        if repeats.size:
            _copy_repeats(outs, repeats, home[repeats])
        return True

    def _blocks(self, slots: np.ndarray) -> list[Any]:
        """The stored blocks of ``slots`` (views into the arena; zeros where none was written)."""
        arena = self.arena
        offsets = arena.offsets[slots]
        ends = (offsets + arena.lengths[slots]).tolist()
        view = arena.view
        if offsets.min(initial=0) >= 0:
            return [view[offset:end] for offset, end in zip(offsets.tolist(), ends)]
        zeros = self._zeros
        return [zeros if offset < 0 else view[offset:end]
                for offset, end in zip(offsets.tolist(), ends)]

    def _decode(self, blocks: list[Any], out: np.ndarray) -> None:
        """Decode ``blocks`` into ``out`` (``[len(blocks), row values]``, each row contiguous):
        a large batch in parts across the worker pool; rows apart (e.g. the last frame of
        each stack) through a buffer copied over."""
        assert self._decoder is not None
        decode, header = self._decoder.decode, self._header
        if not out.flags.c_contiguous:
            rows = np.empty(out.shape, dtype=out.dtype)
            self._split(len(blocks), lambda a, b: decode(header, blocks[a:b], rows[a:b]))
            np.copyto(out, rows)
            return
        self._split(len(blocks), lambda a, b: decode(header, blocks[a:b], out[a:b]))

    def _decode_regions(self, blocks: np.ndarray, outs: list[np.ndarray]) -> None:
        """Decode ``blocks`` (an object array) into ``outs`` one after the other (each
        contiguous ``[rows, row values]``): one job, each destination in parts across the
        worker pool when the whole is large."""
        assert self._decoder is not None
        decode, header = self._decoder.decode, self._header
        total = sum(len(out) for out in outs)
        parts = min(workers.THREADS, max(1, total * self.row_bytes // _PARALLEL_BYTES))
        tasks, at = [], 0
        for out in outs:
            bounds = np.linspace(0, len(out), parts + 1).astype(int).tolist()
            tasks += [(blocks[at + a:at + b].tolist(), out[a:b])
                      for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            at += len(out)
        if parts < 2:
            for mine, out in tasks:
                decode(header, mine, out)
            return
        workers.run_split(lambda task: decode(header, *task), tasks, parts)

    def _decode_joined(self, body: np.ndarray, ends: np.ndarray, out: np.ndarray) -> None:
        """:meth:`_decode` of blocks joined in ``body`` (block ``i`` ends at ``ends[i]``)."""
        assert self._decoder is not None
        decode, header = self._decoder.decode, self._header
        rows = out if out.flags.c_contiguous else np.empty(out.shape, dtype=out.dtype)

        def work(a: int, b: int) -> None:
            start = int(ends[a - 1]) if a else 0
            decode(header, body[start:int(ends[b - 1])], rows[a:b], b - a)

        self._split(len(ends), work)
        if rows is not out:
            np.copyto(out, rows)

    def _split(self, rows: int, work: Callable[[int, int], None]) -> None:
        """``work(a, b)`` over rows ``[0, rows)``: in parts across the worker pool when they
        are large (lz4 releases the GIL)."""
        parts = min(workers.THREADS, max(1, rows * self.row_bytes // _PARALLEL_BYTES))
        if parts < 2:
            work(0, rows)
            return
        bounds = np.linspace(0, rows, parts + 1).astype(int).tolist()
        tasks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        workers.run_split(lambda task: work(*task), tasks, len(tasks))

    def _read_blocks(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Decompress the rows at ``slots`` into ``out`` (``[n, row values]``, each row
        contiguous; zeros where none was written) through python-lz4, one block per call
        (where no batch decoder is). Memoryviews all the way: per row one decompress and
        one copy."""
        size = self.row_bytes
        buffer, decompress = self.arena.view, lz4.block.decompress
        offsets = (self.arena.offsets[slots] + PREFIX).tolist()
        lengths = (self.arena.lengths[slots] - PREFIX).tolist()
        if not out.flags.c_contiguous:
            for i, (offset, length) in enumerate(zip(offsets, lengths)):
                out[i] = 0 if offset < PREFIX else np.frombuffer(
                    decompress(buffer[offset:offset + length], uncompressed_size=size),
                    dtype=out.dtype)
            return
        flat = memoryview(out).cast("B")
        at = 0
        for offset, length in zip(offsets, lengths):
            if offset < PREFIX:
                flat[at:at + size] = bytes(size)
            else:
                flat[at:at + size] = decompress(buffer[offset:offset + length],
                                                uncompressed_size=size)
            at += size

    def __getitem__(self, index: slice) -> np.ndarray:
        slots = np.arange(*index.indices(self.capacity))
        out = np.empty((slots.size, *self.spec.shape), dtype=self.dtype)
        if self._decoder is None:
            self._read_blocks(slots, out.reshape(slots.size, -1))
        else:
            self._decode(self._blocks(slots), out.reshape(slots.size, -1))
        return out

    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        slots = np.arange(*index.indices(self.capacity))
        flat = np.ascontiguousarray(rows).reshape(slots.size, -1)
        blocks = [prefixed(lz4.block.compress(row, store_size=False)) for row in flat]
        self.arena.reserve([len(b) for b in blocks], slots)
        self.arena.write(slots.tolist(), blocks)

    def stats(self) -> dict[str, Any]:
        arena = self.arena
        return {"raw_bytes": arena.blocks * self.row_bytes, "stored_bytes": arena.stored}


def _copy_repeats(outs: list[np.ndarray], at: np.ndarray, home: np.ndarray) -> None:
    """Rows ``at`` of the destinations ``outs`` joined are copies of rows ``home`` (indexes
    into the joined rows; each home is decoded, no copy itself): one memory copy per row,
    no gathered temporary."""
    starts = np.cumsum([0] + [len(out) for out in outs])
    to = np.searchsorted(starts, at, side="right") - 1
    source = np.searchsorted(starts, home, side="right") - 1
    views = [memoryview(out).cast("B") for out in outs]
    size = outs[0].shape[1] * outs[0].itemsize
    for r, d, h, row in zip(to.tolist(), ((at - starts[to]) * size).tolist(), source.tolist(),
                            ((home - starts[source]) * size).tolist()):
        views[r][d:d + size] = views[h][row:row + size]
