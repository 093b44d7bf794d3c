"""Ordered samplers: the rows present, oldest first (``fifo``) or newest first (``lifo``).

A queue table is Reverb's ``Queue``/``Stack`` table: an ordered sampler plus
a remover of limit 1 (:mod:`replay_server.engine.remover`), so a sample of
``B`` hands out the ``B`` oldest (``fifo``) or newest (``lifo``) rows
present, in that order, and they leave the table at once (a learner's stream
therefore sees every row exactly once, in order). The sampler itself only
orders: :meth:`OrderedSampler.sample` names the first ``B`` drawable rows
without removing them; the remover deletes them. With ``max_times_sampled =
k`` a row is handed out ``k`` times before it leaves. A sample waits (or,
without ``wait_for_data``, fails as empty) until ``B`` rows are drawable: a
batch is never short. A queue's ``max_size`` is its rate limiter's
(:mod:`replay_server.engine.rate_limiter`).

Drawable rows are a set of *runs*: half-open position ranges ``[start, end)``
in ascending order. Inserts extend the last run, a delete of the front
(fifo) or back (lifo) shortens a run, a delete elsewhere splits one, and the
ring overwriting its oldest positions trims the front. Without deletes
outside the ends there is one run. A ``lifo`` table's rows still live in the
table's ring, so a row left at the bottom of the stack while ``capacity``
newer rows went in is overwritten (counted in ``evicted``), as in every table.

Cost: insert O(1); sample O(B + runs touched); delete and restore of d
positions O(d log d + r) for r runs, O(d) for the front (back) of a fifo
(lifo). Memory: 16 bytes per run, nothing per row. Not thread-safe: called
under the table's lock.
"""

from __future__ import annotations

import bisect
from typing import Any, ClassVar

import numpy as np
import torch

from replay_proto.mass import SamplingMass, uniform_mass
from replay_server.engine.samplers.base import (
    InsertEvent,
    Removal,
    Sampler,
    SampleIndex,
)
from replay_server.engine.sampler_kinds import FIFO, LIFO
from replay_server.errors import EmptyTableError

class OrderedSampler(Sampler):
    """The drawable rows in insertion order (``lifo``: reverse order). See the module docstring."""

    traits, options = FIFO.traits, FIFO.options  # lifo's are the same
    slot_bytes = staticmethod(FIFO.slot_bytes)
    lifo: ClassVar[bool] = False

    def __init__(self, ring: Any) -> None:
        super().__init__(ring)
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.depth = 0
        """Rows drawable (inserted, not yet taken, deleted or overwritten)."""

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

    def update(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities do not change the order (the table refuses them first)."""

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        """The first ``batch_size`` drawable rows in order (oldest or newest first).

        Raises:
            EmptyTableError: fewer than ``batch_size`` rows are drawable.
        """
        if self.depth < batch_size:
            raise EmptyTableError(f"the queue holds {self.depth} rows and a sample takes "
                                  f"{batch_size}")
        ids = self._back(batch_size) if self.lifo else self._front(batch_size)
        return SampleIndex(
            ids=ids,
            slots=self._ring.slots(ids),
            probabilities=np.ones(batch_size),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def _front(self, n: int) -> np.ndarray:
        pieces = []
        run = 0
        while n:
            start, end = self._starts[run], self._ends[run]
            take = min(n, end - start)
            pieces.append(np.arange(start, start + take, dtype=np.int64))
            n -= take
            run += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _back(self, n: int) -> np.ndarray:
        pieces = []
        run = len(self._starts) - 1
        while n:
            start, end = self._starts[run], self._ends[run]
            take = min(n, end - start)
            pieces.append(np.arange(end - 1, end - take - 1, -1, dtype=np.int64))
            n -= take
            run -= 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def delete(self, positions: np.ndarray) -> Removal:
        """Remove the rows at ``positions`` from the order (all drawable)."""
        if positions.size:
            ordered = np.sort(positions)
            cuts = np.flatnonzero(np.diff(ordered) != 1) + 1
            firsts = ordered[np.concatenate(([0], cuts))].tolist()
            lasts = ordered[np.concatenate((cuts - 1, [ordered.size - 1]))].tolist()
            for first, last in zip(firsts, lasts):
                self._cut(first, last + 1)
            self.depth -= int(positions.size)
        return Removal(positions)

    def _cut(self, first: int, end: int) -> None:
        """Remove the drawable range ``[first, end)`` (runs are maximal, so it lies in one)."""
        run = bisect.bisect_right(self._starts, first) - 1
        start, stop = self._starts[run], self._ends[run]
        if start == first and stop == end:
            del self._starts[run], self._ends[run]
        elif start == first:
            self._starts[run] = end
        elif stop == end:
            self._ends[run] = first
        else:
            self._ends[run] = first
            self._starts.insert(run + 1, end)
            self._ends.insert(run + 1, stop)

    def restore(self, removal: Removal) -> None:
        """Put the rows of ``removal`` that are still live back in their place in the order."""
        back = removal.positions[self._ring.live(removal.positions)]
        if back.size == 0:
            return
        present = [np.arange(s, e, dtype=np.int64) for s, e in zip(self._starts, self._ends)]
        self._set_runs(np.union1d(np.concatenate(present) if present else back, back))

    def _set_runs(self, positions: np.ndarray) -> None:
        """Make the runs those of the ascending, distinct ``positions``."""
        if positions.size == 0:
            self._starts, self._ends, self.depth = [], [], 0
            return
        cuts = np.flatnonzero(np.diff(positions) != 1) + 1
        self._starts = positions[np.concatenate(([0], cuts))].tolist()
        self._ends = (positions[np.concatenate((cuts - 1, [positions.size - 1]))] + 1).tolist()
        self.depth = int(positions.size)

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
        return {"queue_depth": self.depth}

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


class FifoSampler(OrderedSampler):
    """The oldest rows first (a queue)."""

    kind = FIFO.kind


class LifoSampler(OrderedSampler):
    """The newest rows first (a stack)."""

    kind = LIFO.kind
    lifo = True
