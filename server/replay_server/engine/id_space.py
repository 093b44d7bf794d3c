"""Row ids that are never issued twice, not even across crashes and restarts.

A row id is a non-negative int64 of a shard, an incarnation and a sequence
(bits 56..62, 40..55 and 0..39: :mod:`replay_proto.id_layout` holds the layout,
which sharded clients read too).

Inside the engine a table counts its rows by *position*: the n-th row ever
inserted has position n (what :class:`~replay_server.engine.ids.IdRing` and
the samplers call ids; the ring arithmetic ``slot = position % capacity``
and the live range ``[first_live, next_id)`` are unchanged). Positions are
never seen outside the table: :class:`IdSpace` turns them into ids at the
boundary (insert and sample) and ids back into positions (priority updates).

**Segments.** A table's positions are cut into segments ``(incarnation,
first_position, end_position)``: a row at position p in segment s has id
``shard << 56 | s.incarnation << 40 | (p - s.first_position)``. A new
segment starts when the server starts (or restores) with a fresh
incarnation, and when the current segment would pass ``2**40 - 1`` rows.
A crashed run's segment ends, on restore, at the position its last
checkpoint had reached; the ids it issued after that carry its incarnation,
so they can never name the rows the next run writes at the same positions.

**Incarnations** come from an :class:`IncarnationSource`
(:mod:`replay_server.engine.incarnations`): a server with a
``checkpoint_dir`` reads, increments and durably writes a counter there
before it serves (see :mod:`replay_server.checkpoint.incarnation`), so an
incarnation is never given out twice; a server without one draws a random
incarnation (ids of a non-persistent server are unique across its restarts
with probability 1 - 1/65535 per pair of runs); an in-process table with no
server uses :class:`LocalIncarnations` (shard 0, incarnation 0: ids 0, 1, 2,
... as positions).

**Classifying an id** handed to ``update_priorities``:

* negative, or another shard's: invalid (``InvalidIdsError``);
* of incarnation 0 (below ``2**40`` on shard 0) when the table never had a
  segment of incarnation 0 (servers' incarnations start at 1; in-process
  tables and states saved before segments use 0): invalid, never issued;
* the current segment's, with a sequence not issued yet: invalid (never issued);
* anything else that names no live row (an older segment's row since
  overwritten, an id issued after the last checkpoint of a run that
  crashed, an unknown older incarnation): *stale*, ignored and counted.

Limits: 128 shards, 65,536 incarnations (so segments) per table, 2**40 rows
per segment; capacity is at most 2**40 (``TableConfig``).

Cost: id <-> position mapping is one vectorized add when every id is in the
current segment (the usual case), else a dict lookup or a searchsorted over
segment starts per batch. Not thread-safe: owned by its table and used
under the table's lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay_proto.id_layout import (
    MAX_INCARNATION,
    SEGMENT_ROWS,
    SEQUENCE_MASK,
    incarnation_of,
    make_id,
    shard_of,
)
from replay_server.engine.incarnations import IncarnationSource
from replay_server.errors import ConfigError, InvalidIdsError

class IdSpace:
    """One table's segments and the id <-> position mapping (see the module docstring).

    Args:
        source: where new segments get their incarnation (and the shard).
        segment_rows: rows per segment (``2**40``; smaller only in tests of rollover).
    """

    __slots__ = ("shard", "_source", "_segment_rows", "_incarnations", "_firsts", "_ends",
                 "_index", "_base", "_first")

    def __init__(self, source: IncarnationSource, segment_rows: int = SEGMENT_ROWS) -> None:
        self.shard = source.shard
        self._source = source
        self._segment_rows = segment_rows
        self._incarnations: list[int] = []
        self._firsts: list[int] = []
        self._ends: list[int] = []  # end of each segment but the current one
        self._index: dict[int, int] = {}
        self._base = 0  # the current segment's id of sequence 0
        self._first = 0  # the current segment's first position

    @property
    def incarnation(self) -> int:
        """The current segment's incarnation."""
        return self._incarnations[-1]

    @property
    def segments(self) -> list[tuple[int, int, int | None]]:
        """``(incarnation, first_position, end_position)``, oldest first (end ``None``: current)."""
        ends: list[int | None] = [*self._ends, None]
        return list(zip(self._incarnations, self._firsts, ends))

    def begin(self, position: int) -> None:
        """Start a new segment at ``position`` (the previous one, if any, ends there).

        Takes the source's current incarnation, or a new one above every
        incarnation this table has used when the current one is not (an
        in-process table loading a state, a counter file that went back).

        Raises:
            ConfigError: no incarnation is left.
        """
        incarnation = self._source.current
        if self._incarnations and incarnation <= max(self._incarnations):
            incarnation = self._source.advance(max(self._incarnations))
        self._open(incarnation, position)

    def _open(self, incarnation: int, position: int) -> None:
        """Begin the segment of ``incarnation`` at ``position`` (the last one ends there)."""
        if self._incarnations:
            self._ends.append(position)
        self._index[incarnation] = len(self._incarnations)
        self._incarnations.append(incarnation)
        self._firsts.append(position)
        self._first = position
        self._base = make_id(self.shard, incarnation, 0)

    def follow(self, position: int, first_id: int) -> None:
        """Replaying a write-ahead log: make ``position`` get ``first_id``, the id a run that
        logged it gave it (:mod:`replay_server.checkpoint.wal.replay`), so replayed rows keep
        their ids. A current segment with no row yet (the one a restore began) is dropped;
        the logged run's segment is reopened (it ended there) or begun at ``position``.

        Raises:
            ValueError: ``first_id`` cannot be the id of ``position`` in any history of segments.
        """
        if self.id_of(position) == first_id:
            return
        incarnation = int(incarnation_of(first_id))
        start = position - (first_id & SEQUENCE_MASK)
        if self._first == position and len(self._incarnations) > 0:  # empty: drop it
            del self._index[self._incarnations.pop()]
            self._firsts.pop()
            if self._incarnations:
                self._ends.pop()
                self._first = self._firsts[-1]
                self._base = make_id(self.shard, self._incarnations[-1], 0)
            if self._incarnations and self.id_of(position) == first_id:
                return
        if (start != position or shard_of(first_id) != self.shard
                or incarnation in self._index
                or (self._incarnations and incarnation < max(self._incarnations))):
            raise ValueError(f"id {first_id} (incarnation {incarnation}) cannot be position "
                             f"{position}'s; segments: {self.segments}")
        self._open(incarnation, position)

    def resume(self, position: int) -> None:
        """After a log replay: new rows from ``position`` get the source's current incarnation."""
        if self._incarnations[-1] != self._source.current:
            self.begin(position)

    def reserve(self, next_position: int, rows: int) -> None:
        """Make room for ``rows`` new rows from ``next_position``: a new segment if the current one is full.

        Called before an insert changes anything, so a failure here changes nothing.
        """
        if next_position + rows - self._first > self._segment_rows:
            self._source.advance(max(self._incarnations))
            self.begin(next_position)

    def id_of(self, position: int) -> int:
        """The id of ``position``, which lies in the current segment."""
        return self._base + position - self._first

    def ids_of(self, positions: np.ndarray, lowest: int) -> np.ndarray:
        """Ids (int64, same shape) of issued ``positions``, none below ``lowest``."""
        if lowest >= self._first:
            return positions + (self._base - self._first)
        firsts = np.asarray(self._firsts, dtype=np.int64)
        segment = np.searchsorted(firsts, positions, side="right") - 1
        bases = np.asarray([make_id(self.shard, i, 0) for i in self._incarnations],
                           dtype=np.int64)
        return bases[segment] + (positions - firsts[segment])

    def positions_of(self, ids: np.ndarray, next_position: int, table: str) -> np.ndarray:
        """Positions (int64, flat) of ``ids`` (flat int64), -1 for stale ids.

        Raises:
            InvalidIdsError: an id is negative, belongs to another shard, or
                names a sequence the current segment has not issued yet.
        """
        if ids.size == 0:
            return ids.astype(np.int64, copy=True)
        issued = next_position - self._first
        offsets = ids - self._base  # sequences, where the id is of the current segment
        if offsets.min() >= 0 and offsets.max() < issued:
            return offsets + self._first  # the usual case: every id from the current segment
        self._check(ids, issued, table)
        incarnations = incarnation_of(ids)
        sequences = ids & SEQUENCE_MASK
        positions = np.full(ids.shape, -1, dtype=np.int64)
        for incarnation in np.unique(incarnations):
            segment = self._index.get(int(incarnation))
            if segment is None:
                continue  # an unknown (crashed, never checkpointed) incarnation: stale
            first = self._firsts[segment]
            end = self._ends[segment] if segment < len(self._ends) else next_position
            mine = incarnations == incarnation
            position = first + sequences[mine]
            positions[mine] = np.where(position < end, position, -1)
        return positions

    def _check(self, ids: np.ndarray, issued: int, table: str) -> None:
        negative = ids < 0
        if negative.any():
            raise InvalidIdsError(
                f"table {table!r}: {int(ids[negative][0])} is not an id (ids are non-negative "
                f"int64, as returned by insert and sample); {int(negative.sum())} such ids")
        shards = shard_of(ids)
        foreign = shards != self.shard
        if foreign.any():
            first = int(ids[foreign][0])
            raise InvalidIdsError(
                f"table {table!r}: id {first} belongs to shard {shard_of(first)}, and "
                f"this server is shard {self.shard}; {int(foreign.sum())} such ids")
        if 0 not in self._index:
            # Servers' incarnations start at 1, so an id below 2**40 was never issued here:
            # typically a storage position (0..capacity-1) taken for an id.
            small = ids < SEGMENT_ROWS
            if small.any():
                first = int(ids[small][0])
                raise InvalidIdsError(
                    f"table {table!r}: {first} was never issued as an id (ids carry the "
                    f"server's incarnation {self.incarnation} in bits 40..55, so they are "
                    f">= 2**40); it looks like a storage position: read rows by position "
                    f"with client.read(table, positions=...); {int(small.sum())} such ids")
        sequences = ids - self._base
        never = (sequences >= issued) & (sequences < self._segment_rows)
        if never.any():
            first = int(ids[never][0])
            raise InvalidIdsError(
                f"table {table!r}: id {first} was never issued by this table (incarnation "
                f"{self.incarnation} has issued sequences 0..{issued - 1} so far, and this is "
                f"sequence {first - self._base}); {int(never.sum())} such ids")

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the shard and every segment (the current one's end is -1)."""
        return {"shard": self.shard,
                "segments": [[i, f, -1 if e is None else e] for i, f, e in self.segments]}

    def load(self, state: dict[str, Any] | None, next_position: int, table: str) -> None:
        """Take the segments of a saved table whose ring had reached ``next_position``,
        then begin a new segment there (the saved current segment ends at it).

        ``state`` ``None`` (saved before ids had segments): the saved ids were
        positions, i.e. one segment of incarnation 0 on shard 0.

        Raises:
            ConfigError: the state was saved by another shard, or no incarnation is left.
            ValueError: the segments are malformed.
        """
        if state is None:
            state = {"shard": 0, "segments": [[0, 0, -1]]}
        shard = int(state["shard"])
        if shard != self.shard:
            raise ConfigError(f"table {table!r}: config says shard={self.shard} but the saved "
                              f"state has shard={shard} (its ids carry shard {shard})")
        segments = [(int(i), int(f), int(e)) for i, f, e in state["segments"]]
        if not segments:
            raise ValueError("no id segments")
        for k, (incarnation, first, end) in enumerate(segments):
            last = k == len(segments) - 1
            if last and end != -1:
                raise ValueError(f"the last id segment {segments[k]} is not the open one")
            end = next_position if last else end
            if not 0 <= incarnation <= MAX_INCARNATION or not 0 <= first <= end <= next_position:
                raise ValueError(f"inconsistent id segment {segments[k]} (next position "
                                 f"{next_position})")
            if k and first != segments[k - 1][2]:
                raise ValueError(f"id segments {segments[k - 1]} and {segments[k]} do not meet")
        self._incarnations = [i for i, _, _ in segments]
        if len(set(self._incarnations)) != len(segments):
            raise ValueError(f"id segments repeat an incarnation: {self._incarnations}")
        self._firsts = [f for _, f, _ in segments]
        self._ends = [e for _, _, e in segments[:-1]]
        self._index = {i: k for k, i in enumerate(self._incarnations)}
        self.begin(next_position)
