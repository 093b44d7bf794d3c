"""Leases: a queue's rows taken by a sample stay the taker's until it acknowledges them.

A sample from a table whose sampler consumes its rows (``fifo``/``lifo``)
may be taken *under a lease*, named by the caller (a request id). The rows
leave the queue as any sample's do (the remover retires them), but the
lease keeps what is needed to undo that: the sampler's
:class:`~replay_server.engine.samplers.base.Removal` and the batch's
positions, weights and probabilities. Then:

* **acknowledged** (:meth:`Leases.acknowledge`): the lease is dropped; the
  rows are gone for good, as an unleased sample's.
* **taken again** with the same name while held (a retried request whose
  answer was lost): the same rows, read again from storage (:meth:`Leases.held`).
* **expired** (``lease_timeout_s`` after it was taken, :meth:`Leases.due`)
  or **given back** (its taker went away: a stream that ended): the remover
  returns the rows to their place in the queue's order
  (:meth:`~replay_server.engine.table_parts.TableParts.give_back`, through
  :meth:`~replay_server.engine.remover.Remover.give_back`), the rate
  limiter counts them as never sampled nor deleted, and they are handed out
  again.
* **a checkpoint** saves the queue as if every lease had been given back
  (:meth:`~replay_server.engine.table_parts.TableParts.leases_given_back`), so after a crash and restore a lease never
  acknowledged is handed out again (at least once); acknowledged rows are
  not, if the checkpoint came after the acknowledgement.

A lease's rows stay stored until the ring overwrites them, like any row: a
lease whose rows were overwritten before it was acknowledged or taken
again has lost them (a retry of it is refused); a queue whose ``max_size``
leaves room for the rows leased never overwrites them.

Memory: per lease, its rows' positions, weights and probabilities (20 bytes
a row) and a deadline entry (kept under twice the leases held, plus 64);
leases hold distinct rows, so at most ``capacity`` rows in all.
A lease may also be acknowledged in part (:meth:`Leases.acknowledge_first`:
the first draws of a stream's group, the batches its learner finished).
A lease taken with an infinite timeout (a stream's) never expires: the
stream gives it back when it ends.

Cost: O(rows + log leases) to take, acknowledge or return a lease; an
expiry check is O(1) when nothing is due (a heap of deadlines). This
module keeps the books; the table's parts move the rows (the layers meet
only there). Not thread-safe: called under the table's lock.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from replay_proto.mass import SamplingMass
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import Removal, SampleIndex
from replay_server.errors import InvalidArgumentError

MAX_LEASE_NAME = 256
"""Longest lease name (a request id) accepted."""


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """A sample asked for under a lease.

    Attributes:
        name: the lease's name (the caller's request id; unique per taker).
        timeout_s: seconds until it expires unless acknowledged.
    """

    name: str
    timeout_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_LEASE_NAME:
            raise InvalidArgumentError(f"a lease name must be 1-{MAX_LEASE_NAME} characters, "
                                       f"got {str(self.name)[:64]!r}")


@dataclass(slots=True)
class Lease:
    """Rows a sample took and its taker has not acknowledged yet."""

    name: str
    index: SampleIndex
    removals: list[Removal]
    mass: SamplingMass | None
    deadline: float

    @property
    def rows(self) -> int:
        return sum(removal.positions.size for removal in self.removals)

    @property
    def positions(self) -> np.ndarray:
        """The positions of the rows it holds (int64; slice starts on a slice table)."""
        if not self.removals:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([removal.positions for removal in self.removals])


class Leases:
    """The leases of one table (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # a heap; entries of leases gone
        self._taken = itertools.count()                     # are skipped when they come up

    def __len__(self) -> int:
        return len(self._held)

    def all(self) -> list[Lease]:
        """The leases held, oldest first."""
        return list(self._held.values())

    @property
    def rows(self) -> int:
        """Rows held by leases now."""
        return sum(lease.rows for lease in self._held.values())

    def get(self, name: str) -> Lease | None:
        """The lease ``name`` if it is held (its rows may have been overwritten since)."""
        return self._held.get(name)

    def held(self, name: str, ring: IdRing) -> Lease | None:
        """The lease ``name`` if it is held and its rows are still stored.

        Raises:
            InvalidArgumentError: it is held but the ring overwrote some of its
                rows (the lease is dropped: those rows are gone).
        """
        lease = self._held.get(name)
        if lease is None:
            return None
        if not ring.live(lease.index.ids.reshape(-1)).all():
            del self._held[name]
            raise InvalidArgumentError(
                f"the rows of lease {name[:64]!r} were overwritten by newer inserts before it "
                f"was taken again (the table's capacity); they are gone")
        return lease

    def hold(self, request: LeaseRequest, index: SampleIndex, removals: list[Removal],
             mass: SamplingMass | None, now: float | None = None) -> None:
        """Keep what a sample just took under ``request``."""
        now = time.monotonic() if now is None else now
        lease = Lease(request.name, index, removals, mass, now + request.timeout_s)
        self._held[request.name] = lease
        heapq.heappush(self._deadlines, (lease.deadline, next(self._taken), request.name))

    def acknowledge(self, names: Iterable[str]) -> int:
        """Drop the leases ``names`` (unknown names are ignored); the rows they acknowledged."""
        rows = 0
        for name in names:
            lease = self._held.pop(name, None)
            if lease is not None:
                rows += lease.rows
        if len(self._deadlines) > 2 * len(self._held) + 64:  # drop entries of leases gone
            self._deadlines = [entry for entry in self._deadlines if entry[2] in self._held
                               and self._held[entry[2]].deadline == entry[0]]
            heapq.heapify(self._deadlines)
        return rows

    def acknowledge_first(self, name: str, units: int) -> int:
        """Acknowledge the first ``units`` draws of the lease ``name`` (rows, or slices);
        the rest stay held. What a stream's group whose learner finished only some of its
        batches needs (:mod:`replay_server.service.stream_leases`). Returns the rows
        acknowledged; an unknown name is ignored. O(rows of the lease)."""
        lease = self._held.get(name)
        if lease is None or units <= 0:
            return 0
        index = lease.index
        if units >= index.ids.shape[0]:
            return self.acknowledge([name])
        done = index.ids[:units].reshape(-1)
        before = lease.rows
        kept = []
        for removal in lease.removals:
            keep = ~np.isin(removal.positions, done)
            kept.append(Removal(removal.positions[keep],
                                None if removal.values is None else removal.values[keep]))
        lease.removals = kept
        lease.index = SampleIndex(index.ids[units:], index.slots[units:],
                                  index.probabilities[units:], index.weights[units:])
        return before - lease.rows

    def due(self, now: float | None = None) -> list[Lease]:
        """Remove and return the leases expired by ``now``, in the order they expired."""
        now = time.monotonic() if now is None else now
        expired = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, _, name = heapq.heappop(deadlines)
            lease = self._held.get(name)
            if lease is not None and lease.deadline == deadline:
                del self._held[name]
                expired.append(lease)
        if not self._held:
            deadlines.clear()
        return expired

    def take_back(self, names: Iterable[str]) -> list[Lease]:
        """Remove and return the leases ``names`` that are held (their taker went away)."""
        return [lease for name in names if (lease := self._held.pop(name, None)) is not None]

    def clear(self) -> None:
        """Forget every lease (the table was reset or loaded: their rows are gone)."""
        self._held.clear()
        self._deadlines.clear()
