"""Variable-size blobs (compressed rows) in fixed-size segments of RAM or of a sparse file.

A compressed column (:mod:`~replay_server.engine.storage.compressed`) keeps
each row as one lz4 block of its own size. The blocks live in an arena of
equal *segments* (64 blocks of the largest size a row can take, up to 4 MiB;
smaller in a small arena): a write appends its blocks to the segment being filled, then
to a free one; a block overwritten (its slot written again) frees its bytes,
and a segment whose bytes are all free goes back on the free list (last
freed, first reused, so the segments in use stay the same few). The ring
overwrites rows in insertion order, so segments empty in the order they
filled and the arena holds about the live blocks' bytes plus two segments.

The arena's address range is reserved for the worst case (every row at
lz4's bound), but only the segments taken cost anything: in RAM, pages the
kernel backs when they are first written, each segment promised to the
server's memory ledger when it is first taken (``grow``); in a file (a
``memmap`` column), disk blocks reserved a segment at a time (a sparse file
otherwise). Both happen in :meth:`ByteArena.reserve`, before the insert that
needs them changes anything, so a full disk or an exhausted ledger refuses
the insert whole. Should some order of writes leave too many segments
partly used for a write to find room (never with the ring's order), the
arena is compacted first (its live blocks copied into place again).

Memory: 12 bytes per slot (offset and length) plus the segments taken.
Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from replay_server.engine.storage.memmap import MappedFile

_PAGE = 4096
_MAX_SEGMENT = 4 << 20


def segment_bytes(capacity: int, largest: int) -> int:
    """Bytes per segment for ``capacity`` blocks of at most ``largest`` bytes: 64 blocks up to
    4 MiB, a sixteenth of the worst case for a small arena, and two blocks at least."""
    size = max(2 * largest, min(_MAX_SEGMENT, 64 * largest, -(-capacity * largest // 16)))
    return -(-size // _PAGE) * _PAGE


def segment_count(capacity: int, largest: int) -> int:
    """Segments enough for ``capacity`` blocks of at most ``largest`` bytes written in ring
    order: all of them at their largest (a segment wastes less than one block at its end),
    the one being filled and the oldest, partly freed."""
    size = segment_bytes(capacity, largest)
    return -(-capacity * largest // (size - largest)) + 3


class ByteArena:
    """Blocks of bytes by slot (see the module docstring).

    Args:
        capacity: slots.
        largest: the most bytes one block can take.
        file: a sparse file to keep the segments in (``None``: RAM).
        grow: called with the bytes of segments taken so far, before a new one
            is first taken; it raises to refuse (nothing changes then).
    """

    def __init__(self, capacity: int, largest: int, file: MappedFile | None = None,
                 grow: Callable[[int], None] | None = None) -> None:
        self.segment = segment_bytes(capacity, largest)
        self.segments = segment_count(capacity, largest)
        self.largest = largest
        total = self.segments * self.segment
        self._file = file
        self.buffer = (np.empty(total, dtype=np.uint8) if file is None
                       else file.array(np.dtype(np.uint8), (total,)))
        self.view = memoryview(self.buffer)
        """The arena as a memoryview (slicing it costs less than slicing the array)."""
        self.offsets = np.full(capacity, -1, dtype=np.int64)
        self.lengths = np.zeros(capacity, dtype=np.int32)
        self._live = np.zeros(self.segments, dtype=np.int64)  # bytes of live blocks per segment
        self._free = list(range(self.segments - 1, -1, -1))  # pop() takes the lowest first
        self._head = -1  # the segment being filled, and where
        self._cursor = 0
        self._taken = 0  # segments ever taken (their memory promised or disk reserved)
        self._grow = grow
        self.stored = 0  # bytes of live blocks
        self.blocks = 0  # live blocks

    @staticmethod
    def file_bytes(capacity: int, largest: int) -> int:
        """The address range an arena of ``capacity`` blocks reserves."""
        return segment_count(capacity, largest) * segment_bytes(capacity, largest)

    @property
    def nbytes(self) -> int:
        """Bytes held now: the segments in use, and the per-slot offsets and lengths."""
        in_use = self.segments - len(self._free)
        return in_use * self.segment + self.offsets.size * 12

    # ------------------------------------------------------------------ writes

    def reserve(self, sizes: Sequence[int], slots: np.ndarray) -> None:
        """Make room for blocks of ``sizes`` written to ``slots`` (whose blocks they replace).

        Stores nothing: compacts the arena if the write would not find room,
        and promises (RAM) or reserves (disk) the segments it may take for the
        first time. Segments are taken lowest first and freed ones reused
        before untaken ones, so the segments ever taken are ``0 .. taken - 1``.

        Raises:
            InsufficientMemoryError: the ledger or the disk refused a segment; nothing changed.
        """
        need = self._segments_needed(sizes)
        if need > len(self._free) + self._freed_by(slots):
            self._compact()
        reused = sum(1 for segment in self._free if segment < self._taken)
        fresh = min(max(0, need - reused), self.segments - self._taken)
        if fresh:
            taken = self._taken + fresh
            if self._file is not None:
                self._file.reserve(self._taken * self.segment, fresh * self.segment)
            elif self._grow is not None:
                self._grow(taken * self.segment)
            self._taken = taken

    def _segments_needed(self, sizes: Sequence[int]) -> int:
        """New segments a write of ``sizes`` may take (at most), after the one being filled."""
        total = int(sum(sizes))
        room = self.segment - self._cursor if self._head >= 0 else 0
        if total <= room:
            return 0
        return -(-(total - room) // (self.segment - self.largest)) + 1

    def _freed_by(self, slots: np.ndarray) -> int:
        """Segments a write to ``slots`` empties (all their live blocks are those slots')."""
        offsets = self.offsets[slots]
        held = offsets >= 0
        if not held.any():
            return 0
        segments = offsets[held] // self.segment
        freed = np.bincount(segments, weights=self.lengths[slots][held],
                            minlength=self.segments)
        emptied = (freed > 0) & (freed >= self._live)
        if self._head >= 0:
            emptied[self._head] = False
        return int(emptied.sum())

    def write(self, slots: Sequence[int], blocks: Sequence[bytes]) -> None:
        """Store ``blocks`` for ``slots`` (after :meth:`reserve` for them), freeing the old ones."""
        for slot, block in zip(slots, blocks):
            self._release(slot)
            size = len(block)
            if self._head < 0 or self._cursor + size > self.segment:
                self._next_segment()
            offset = self._head * self.segment + self._cursor
            self.view[offset:offset + size] = block
            self.offsets[slot] = offset
            self.lengths[slot] = size
            self._live[self._head] += size
            self._cursor += size
            self.stored += size
            self.blocks += 1

    # ------------------------------------------------------------------ reads

    def joined(self, slots: np.ndarray, widest: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The blocks of ``slots`` one after the other, gathered without a Python step per
        block, or ``None`` where they are not all written and at most ``widest`` bytes.

        numpy takes a window of the widest block's bytes at each block's offset (one
        fancy index of a strided view), then keeps each window's first ``length``
        bytes. Cost: O(len(slots) * widest) bytes copied twice: cheaper than a slice
        per block while blocks are small (a few hundred bytes, e.g. compressed small
        observations), dearer for larger ones.

        Returns:
            ``(body, ends)``: the joined blocks (uint8) and where each block ends in it.
        """
        offsets, lengths = self.offsets[slots], self.lengths[slots]
        width = int(lengths.max(initial=0))
        if (not 0 < width <= widest or offsets.min() < 0
                or offsets.max() > self.buffer.size - width):
            return None
        windows = np.lib.stride_tricks.as_strided(
            self.buffer, shape=(self.buffer.size - width + 1, width), strides=(1, 1),
            writeable=False)
        body = windows[offsets][np.arange(width) < lengths[:, None]]
        return body, np.cumsum(lengths, dtype=np.int64)

    def _release(self, slot: int) -> None:
        offset = int(self.offsets[slot])
        if offset < 0:
            return
        size = int(self.lengths[slot])
        segment = offset // self.segment
        self._live[segment] -= size
        self.stored -= size
        self.blocks -= 1
        self.offsets[slot] = -1
        if self._live[segment] == 0 and segment != self._head:
            self._free.append(segment)

    def _next_segment(self) -> None:
        if self._head >= 0 and self._live[self._head] == 0:
            self._free.append(self._head)
        if not self._free:  # reserve() rules this out
            raise AssertionError("the arena ran out of segments")
        assert self._free[-1] < self._taken, "a segment was taken before it was reserved"
        self._head = self._free.pop()
        self._cursor = 0

    def _compact(self) -> None:
        """Copy every live block into place again, from the first segment on (they fit in
        the segments taken: packed, they take no more than they did)."""
        live = np.flatnonzero(self.offsets >= 0)
        blocks = [bytes(self.block(int(slot))) for slot in live]  # type: ignore[arg-type]
        self.clear()
        self.write(live.tolist(), blocks)

    def clear(self) -> None:
        """Forget every block (the segments taken stay promised)."""
        self.offsets[:] = -1
        self._live[:] = 0
        self._free = list(range(self.segments - 1, -1, -1))
        self._head, self._cursor, self.stored, self.blocks = -1, 0, 0, 0

    # ------------------------------------------------------------------- reads

    def block(self, slot: int) -> np.ndarray | None:
        """The block of ``slot`` (a view into the arena), or ``None`` if none was written."""
        offset = int(self.offsets[slot])
        if offset < 0:
            return None
        return self.buffer[offset:offset + int(self.lengths[slot])]
