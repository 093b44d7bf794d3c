"""Queue and stack tables: each row is handed out once, oldest first (fifo) or newest first (lifo).

A queue table is Reverb's ``Queue``/``Stack`` table: the sampler is also the
remover. A sample of ``B`` takes the ``B`` oldest (``fifo``) or newest
(``lifo``) rows present, in that order, and they leave the table at once
(a learner's stream therefore sees every row exactly once, in order). A
sample waits (or, without ``wait_for_data``, fails as empty) until the queue
holds ``B`` rows: a batch is never short. With ``max_size`` an insert of
``n`` rows waits while the queue holds more than ``max_size - n`` rows (see
:meth:`QueueSampler.check_insert`); the service turns that into waiting
with a deadline (:mod:`replay_server.service.waiting`).

Rows present are a set of *runs*: half-open position ranges ``[start, end)``
in ascending order. Inserts extend the last run, a fifo sample takes from
the front of the first, a lifo sample from the back of the last, a delete
splits a run, and the ring overwriting its oldest positions trims the front.
Without deletes there is one run. A ``lifo`` table's rows still live in the
table's ring, so a row left at the bottom of the stack while ``capacity``
newer rows went in is overwritten (counted in ``evicted``), as in every table.

Cost: insert O(1); sample O(B + runs touched); delete of d ids O(d log r + r)
for r runs. Memory: 16 bytes per run, nothing per row. Not thread-safe:
called under the table's lock.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import torch

from replay_proto.mass import SamplingMass, uniform_mass
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import InsertEvent, Sampler, SampleIndex, SamplerTraits
from replay_server.errors import EmptyTableError, InvalidArgumentError, RateLimitedError


class QueueSampler(Sampler):
    """Consume-once sampling in insertion order (``lifo``: reverse order). See the module docstring.

    Args:
        ring: the table's id ring (positions).
        lifo: take the newest rows first (a stack) instead of the oldest.
        max_size: rows the queue holds at most before inserts wait (``None``: no limit).
    """

    traits = SamplerTraits(consumes=True, ordered=True, mergeable=False)

    def __init__(self, ring: IdRing, *, lifo: bool, max_size: int | None) -> None:
        super().__init__(ring)
        self.lifo = lifo
        self.max_size = max_size
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.depth = 0
        """Rows present (inserted, not yet taken, deleted or overwritten)."""

    # ------------------------------------------------------------ flow control

    def check_insert(self, rows: int, table: str) -> None:
        """Raise unless ``rows`` more fit under ``max_size`` now; change nothing.

        Raises:
            InvalidArgumentError: ``rows`` exceeds ``max_size``: it could never go in.
            RateLimitedError: the queue is too full now; samples will make room.
        """
        if self.max_size is None:
            return
        if rows > self.max_size:
            raise InvalidArgumentError(
                f"table {table!r}: an insert of {rows} rows can never fit a queue of "
                f"max_size={self.max_size}; split it")
        if self.depth + rows > self.max_size:
            raise RateLimitedError(
                f"table {table!r}: the queue holds {self.depth} of max_size={self.max_size} "
                f"rows, no room for {rows} more; it waits for samples",
                table=table, operation="insert", count=rows)

    def may_insert(self, rows: int) -> bool:
        """Lock-free hint: would an insert of ``rows`` fit now?"""
        return self.max_size is None or self.depth + rows <= self.max_size

    # ------------------------------------------------------------ the interface

    def insert(self, event: InsertEvent) -> None:
        if event.evicted:
            self._trim_below(self._ring.first_live)
        start, end = event.first_id, event.first_id + event.count
        if self._ends and self._ends[-1] == start:
            self._ends[-1] = end
        else:
            self._starts.append(start)
            self._ends.append(end)
        self.depth += event.count

    def dropped_by(self, depth_before: int, inserted: int) -> int:
        """Rows an insert of ``inserted`` overwrote while still present (after :meth:`insert`)."""
        return depth_before + inserted - self.depth

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        """Take ``batch_size`` rows (oldest or newest first) away from the queue.

        Raises:
            EmptyTableError: fewer than ``batch_size`` rows are present (nothing taken).
        """
        if self.depth < batch_size:
            raise EmptyTableError(f"the queue holds {self.depth} rows and a sample takes "
                                  f"{batch_size}")
        pieces = self._take_back(batch_size) if self.lifo else self._take_front(batch_size)
        ids = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        self.depth -= batch_size
        return SampleIndex(
            ids=ids,
            slots=self._ring.slots(ids),
            probabilities=np.ones(batch_size),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def _take_front(self, n: int) -> list[np.ndarray]:
        pieces = []
        while n:
            start, end = self._starts[0], self._ends[0]
            take = min(n, end - start)
            pieces.append(np.arange(start, start + take, dtype=np.int64))
            n -= take
            if start + take == end:
                del self._starts[0], self._ends[0]
            else:
                self._starts[0] = start + take
        return pieces

    def _take_back(self, n: int) -> list[np.ndarray]:
        pieces = []
        while n:
            start, end = self._starts[-1], self._ends[-1]
            take = min(n, end - start)
            pieces.append(np.arange(end - 1, end - take - 1, -1, dtype=np.int64))
            n -= take
            if end - take == start:
                del self._starts[-1], self._ends[-1]
            else:
                self._ends[-1] = end - take
        return pieces

    def delete(self, positions: np.ndarray) -> int:
        """Remove the rows at ``positions`` that are present; returns how many were.

        Positions of rows already taken, deleted or overwritten are ignored.
        """
        removed = 0
        for position in np.unique(positions).tolist():
            run = bisect.bisect_right(self._starts, position) - 1
            if run < 0 or position >= self._ends[run]:
                continue
            start, end = self._starts[run], self._ends[run]
            removed += 1
            if start == position and end == position + 1:
                del self._starts[run], self._ends[run]
            elif start == position:
                self._starts[run] = position + 1
            elif end == position + 1:
                self._ends[run] = position
            else:
                self._ends[run] = position
                self._starts.insert(run + 1, position + 1)
                self._ends.insert(run + 1, end)
        self.depth -= removed
        return removed

    def _trim_below(self, first_live: int) -> None:
        """Forget positions below ``first_live`` (the ring overwrote them)."""
        while self._starts and self._ends[0] <= first_live:
            self.depth -= self._ends[0] - self._starts[0]
            del self._starts[0], self._ends[0]
        if self._starts and self._starts[0] < first_live:
            self.depth -= first_live - self._starts[0]
            self._starts[0] = first_live

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self.depth = 0

    def mass(self) -> SamplingMass:
        """Each row waiting in the queue counts one (a sharded client does not merge
        queue samples; ``info`` reports it like any table's)."""
        return uniform_mass(self.depth)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"queue_depth": self.depth}
        if self.max_size is not None:
            stats["max_size"] = self.max_size
        return stats

    def state_dict(self) -> dict[str, Any]:
        runs = np.array([self._starts, self._ends], dtype=np.int64).reshape(2, -1)
        return {"runs": torch.from_numpy(runs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        runs = state["runs"].numpy()
        starts, ends = runs[0].tolist(), runs[1].tolist()
        ring = self._ring
        if any(not ring.first_live <= s < e <= ring.next_id for s, e in zip(starts, ends)) or \
                any(e > s for e, s in zip(ends[:-1], starts[1:])):
            raise ValueError("queue runs are not ascending, disjoint ranges of live positions")
        self._starts, self._ends = starts, ends
        self.depth = sum(e - s for s, e in zip(starts, ends))
