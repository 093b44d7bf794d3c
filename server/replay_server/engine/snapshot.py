"""Consistent snapshots of a table that cost its users only short pauses.

A checkpoint must save a table exactly as it was at one instant while
inserts and samples go on. Copying a table's rows under its lock would stop
every caller for the whole copy (about half a second per GB here), so a
snapshot is taken in two parts:

* At the **instant**, under the table's lock, everything except the rows is
  copied: the id counters, the sampler's state (priorities, episode index),
  counters and random generator (:meth:`Table.snapshot
  <replay_server.engine.table.Table.snapshot>`). These are a few bytes per slot.
* The **rows** are read out afterwards, in pieces of about ``chunk_bytes``,
  each copied under a short hold of the lock (:class:`StorageSnapshot`).

The rows are read in *ring order*: starting with the slot the next insert
will overwrite (the oldest row) and following the ring, which is exactly the
order in which inserts overwrite slots. An insert that is about to overwrite
rows the reader has not copied yet first copies them aside itself (copy on
write, at row-range granularity, inside the insert's own lock hold), and the
reader hands those copies out in turn. So every piece holds the rows of the
instant, whatever was inserted since, and an insert pays at most one extra
copy of its own rows, only while it runs ahead of the reader.

Extra memory: one piece being read, plus the rows inserts had to copy aside
(at most the rows inserted during the snapshot, never more than the table).

Ring positions: position ``j`` (0 <= j < capacity) is slot
``(origin + j) % capacity``, where ``origin`` is the slot the next insert
writes. Slots ever written are ``0 .. used - 1``; they occupy the last
``used`` positions, so the saved rows are positions ``capacity - used ..
capacity - 1``, and saved row ``i`` (in the order pieces come out) is slot
``(first_slot + i) % capacity``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay_proto.dtypes import tensor_view

DEFAULT_CHUNK_BYTES = 8 << 20
"""Bytes of rows copied per lock hold: about 2 ms of copying here."""

_ALIGN = 64


class Arena:
    """Memory for the copies made at a snapshot's instant, touched before the lock is taken.

    The instant copies the samplers' per-slot arrays (priority leaves,
    episode links: 100 MB and more for tens of millions of rows) under the
    table's lock. Into fresh memory, each first touch of a page faults into the
    kernel (and, on a virtual machine, into the host), which can cost far more
    than the copy itself; into an arena touched beforehand, outside the lock,
    the copy runs at memory speed. Sized from the previous snapshot (its
    :attr:`wanted`); what does not fit is copied the ordinary way.

    Activate it around the copies with :meth:`active`; :func:`saved_copy`
    draws from it. Not thread-safe: one thread uses it.
    """

    def __init__(self, nbytes: int) -> None:
        self._buffer = np.ones(nbytes, dtype=np.uint8)  # ones: every page touched now
        self._used = 0
        self.wanted = 0  # bytes the copies asked for (the next arena's size)

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = -(-nbytes // _ALIGN) * _ALIGN
        self.wanted += size
        if self._used + size > self._buffer.size:
            return None
        out = self._buffer[self._used : self._used + nbytes].view(dtype).reshape(shape)
        self._used += size
        return out

    @contextmanager
    def active(self) -> Iterator[Arena]:
        token = _ARENA.set(self)
        try:
            yield self
        finally:
            _ARENA.reset(token)


_ARENA: ContextVar[Arena | None] = ContextVar("replay_server_snapshot_arena", default=None)


def saved_copy(array: np.ndarray, dtype: Any = None) -> np.ndarray:
    """A copy of ``array`` (as ``dtype``) for a state dict: from the active :class:`Arena`
    of a snapshot's instant when there is one, else a fresh array. O(array)."""
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    arena = _ARENA.get()
    out = None if arena is None else arena.take(array.shape, dtype)
    if out is None:
        return array.astype(dtype, copy=True)
    np.copyto(out, array, casting="safe")
    return out


@dataclass(frozen=True, slots=True)
class RowPiece:
    """Saved rows ``row .. row + count - 1`` (in ring order), which sit in slots
    ``slot .. slot + count - 1`` (never wrapping).

    ``columns`` maps each flat key to a ``[count, *shape]`` numpy array
    (bfloat16 columns as int16 of the same bits): the piece's own copy, or,
    for pieces read from storage, a reused buffer (see
    :meth:`StorageSnapshot.pieces`).
    """

    row: int
    slot: int
    count: int
    columns: dict[str, np.ndarray]


class StorageSnapshot:
    """The rows of a :class:`~replay_server.engine.storage.memory.ColumnStorage` as they were at one instant.

    Created by :meth:`ColumnStorage.snapshot
    <replay_server.engine.storage.memory.ColumnStorage.snapshot>` under the table's lock;
    read with :meth:`pieces` (or :meth:`columns`) from any one thread; must be
    closed (it is a context manager) so inserts stop copying rows aside.

    Thread-safety: :meth:`before_write` runs inside the storage's writes,
    under the table's lock; the reader takes the same lock for each piece.
    """

    def __init__(
        self,
        views: dict[str, np.ndarray],
        dtypes: dict[str, torch.dtype],
        lock: threading.Lock,
        origin: int,
        used: int,
        row_bytes: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_close: Callable[[StorageSnapshot], None] | None = None,
    ) -> None:
        capacity = next(iter(views.values())).shape[0]
        self.capacity = capacity
        self.used = used
        self.first_slot = (origin + capacity - used) % capacity
        self._views = views
        self._dtypes = dtypes
        self._lock = lock
        self._origin = origin
        self._skip = capacity - used  # positions before this hold nothing to save
        self._taken = self._skip  # positions < _taken were copied (by the reader or aside)
        self._written = 0  # positions overwritten since the instant
        self._aside: deque[RowPiece] = deque()
        self._chunk_rows = max(1, chunk_bytes // row_bytes) if row_bytes else capacity
        self._on_close = on_close
        self.closed = False

    # --------------------------------------------------------- writer side

    def before_write(self, first_slot: int, count: int) -> None:
        """Copy aside the saved rows that writing ``count`` rows at ``first_slot`` would
        overwrite before the reader got them. Called under the table's lock.

        Inserts write the ring in order from ``origin``; a write anywhere else
        (never expected) copies every row not read yet, which is always correct.
        """
        if self.closed or self._taken >= self.capacity:
            return
        if first_slot == (self._origin + self._written) % self.capacity:
            end = min(self.capacity, self._written + count)
        else:
            end = self.capacity
        self._written += count
        if end > self._taken:
            self._aside.extend(self._copy(self._taken, end))
            self._taken = end

    # --------------------------------------------------------- reader side

    def pieces(self) -> Iterator[RowPiece]:
        """The saved rows, in ring order (oldest first), one short lock hold per piece.

        A piece's arrays are valid until the next piece is asked for: pieces
        read from storage reuse one buffer per column, touched once before the
        first copy, so the copy under the lock never waits for the kernel to
        hand out fresh pages (which costs more than the copy itself).
        """
        buffers = {
            key: np.ones((min(self._chunk_rows, self.used), *view.shape[1:]), dtype=view.dtype)
            for key, view in self._views.items()
        } if self.used else {}
        while True:
            with self._lock:
                if self._aside:
                    piece = self._aside.popleft()
                elif self._taken < self.capacity:
                    end = min(self.capacity, self._taken + self._chunk_rows)
                    piece = self._copy(self._taken, end, buffers)[0]
                    self._taken = piece.row + self._skip + piece.count
                else:
                    return
            yield piece

    def columns(self) -> dict[str, torch.Tensor]:
        """All saved rows as ``[used, ...]`` tensors in slot order (slot ``i`` at row ``i``)."""
        out = {
            key: np.empty((self.used, *view.shape[1:]), dtype=view.dtype)
            for key, view in self._views.items()
        }
        for piece in self.pieces():
            for key, rows in piece.columns.items():
                out[key][piece.slot : piece.slot + piece.count] = rows
        return {key: tensor_view(array, self._dtypes[key]) for key, array in out.items()}

    def close(self) -> None:
        """Stop tracking writes and drop rows copied aside (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._aside.clear()
            if self._on_close is not None:
                self._on_close(self)

    def __enter__(self) -> StorageSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _copy(
        self, start: int, end: int, out: dict[str, np.ndarray] | None = None
    ) -> list[RowPiece]:
        """Copies of positions ``start .. end - 1``, split where the slots wrap (into
        ``out``'s leading rows when given: then only the first piece is made)."""
        pieces = []
        wrap = self.capacity - self._origin  # position of slot 0
        for a, b in ((start, min(end, wrap)), (max(start, wrap), end)):
            if a >= b:
                continue
            slot = (self._origin + a) % self.capacity
            if out is None:
                columns = {k: v[slot : slot + b - a].copy() for k, v in self._views.items()}
            else:
                columns = {k: out[k][: b - a] for k in self._views}
                for key, view in self._views.items():
                    np.copyto(columns[key], view[slot : slot + b - a])
            pieces.append(RowPiece(row=a - self._skip, slot=slot, count=b - a, columns=columns))
            if out is not None:
                break
        return pieces


class TableSnapshot:
    """A table at one instant: ``state`` (everything but the rows) and ``rows``.

    ``state`` is :meth:`Table.state_dict <replay_server.engine.table.Table.state_dict>`'s
    layout with ``"columns"`` left empty; ``rows`` is ``None`` before the
    table's first insert. Close it (it is a context manager) when done.
    """

    def __init__(self, state: dict[str, Any], rows: StorageSnapshot | None) -> None:
        self.state = state
        self.rows = rows

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()

    def __enter__(self) -> TableSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
