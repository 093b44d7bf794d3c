"""``max_times_sampled``: rows retire after k draws, and no batch over-draws a row.

A table with ``max_times_sampled = k`` counts how often each stored row has
been returned. A row returned k times is *retired*: its sampler stops drawing
it (:meth:`~replay_server.engine.samplers.base.Sampler.remove`: a prioritized row's
mass is zeroed, a uniform row leaves the set of drawable rows), it no longer
counts in the table's size, priority updates for it are ignored as stale, and
it stays stored until the ring overwrites it. For the rate limiter a
retirement is a delete, as in Reverb. Slice samplers refuse
``max_times_sampled`` (see :class:`~replay_server.engine.config.TableConfig`).

Draws within a batch are with replacement, so a batch may draw a row more
often than it has draws left. :meth:`Retirement.draw` settles draws in batch
order: a row keeps its first ``k - count`` draws, and the others are drawn
again among the rows still drawable, until every draw is settled. Each round
that leaves draws unsettled retires at least one row, so there are at most
``batch_size`` rounds (almost always one).

Memory: one uint32 per slot. Cost: ``inserted`` O(n) for n rows; ``draw``
O(B log B) per round plus the sampler's draws. Not thread-safe: called under
the table's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    RateLimitedError,
)
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import Sampler, SampleIndex


class Retirement:
    """Per-row draw counts of a table with ``max_times_sampled`` (see the module docstring).

    Args:
        capacity: the table's capacity (slots).
        limit: ``max_times_sampled`` (>= 1).

    Attributes:
        retired: rows stored but retired.
        draws_left: draws the stored, unretired rows have left, together.
    """

    def __init__(self, capacity: int, limit: int) -> None:
        self.limit = limit
        self._counts = np.zeros(capacity, dtype=np.uint32)
        self.retired = 0
        self.draws_left = 0

    def drawable(self, slots: np.ndarray) -> np.ndarray:
        """Bool mask: which of ``slots`` (of live rows) are not retired."""
        return self._counts[slots] < self.limit

    def inserted(self, slots: np.ndarray, evicted_slots: np.ndarray) -> int:
        """New rows were written to ``slots``, overwriting the rows at ``evicted_slots``.

        Returns:
            How many of the overwritten rows had already retired (their delete
            was counted when they retired).
        """
        retired_gone = 0
        if evicted_slots.size:
            counts = self._counts[evicted_slots].astype(np.int64)
            gone = counts >= self.limit
            retired_gone = int(gone.sum())
            self.retired -= retired_gone
            self.draws_left -= int((self.limit - counts[~gone]).sum())
        self._counts[slots] = 0
        self.draws_left += self.limit * int(slots.size)
        return retired_gone

    def check_sample(self, batch_size: int, table: str, *, can_wait: bool) -> None:
        """Raise unless the rows left can give ``batch_size`` draws; change nothing.

        Raises:
            InvalidArgumentError: more draws than a full table ever has.
            RateLimitedError: (``can_wait``, a table with a rate limiter) too
                few draws left now; inserts will add more.
            EmptyTableError: (no rate limiter) too few draws left now.
        """
        capacity = self._counts.size
        if batch_size > capacity * self.limit:
            raise InvalidArgumentError(
                f"table {table!r}: a sample of {batch_size} rows can never be served: "
                f"capacity={capacity} rows of max_times_sampled={self.limit} draws each allow "
                f"at most {capacity * self.limit}"
            )
        if batch_size > self.draws_left:
            why = (f"a sample of {batch_size} rows needs more draws than the rows stored have "
                   f"left ({self.draws_left}) before they reach max_times_sampled={self.limit}")
            if can_wait:
                raise RateLimitedError(f"table {table!r}: {why}; it waits for inserts",
                                       table=table, operation="sample", count=batch_size)
            raise EmptyTableError(f"{why}; insert more rows")  # the table names itself

    def sample(
        self, sampler: Sampler, batch_size: int, generator: np.random.Generator, table: str,
        *, can_wait: bool,
    ) -> tuple[SampleIndex, np.ndarray]:
        """Draw a batch in which no row exceeds its draws left; retire rows that reach the limit.

        Returns:
            The batch, and the slots of the rows it retired (int64, distinct).

        Raises:
            InvalidArgumentError, RateLimitedError, EmptyTableError: as
                :meth:`check_sample`; or EmptyTableError when the rows that
                can still be drawn ran out (e.g. the others have priority 0).
                The counts, the sampler and the generator are then as before.
        """
        self.check_sample(batch_size, table, can_wait=can_wait)
        random_state = generator.bit_generator.state
        index = sampler.sample(batch_size, generator)
        ids, slots = index.ids, index.slots
        probabilities, weights = index.probabilities, index.weights
        pending = np.arange(batch_size)
        taken: list[tuple[np.ndarray, np.ndarray]] = []
        undo: list[Callable[[], None]] = []
        retired: list[np.ndarray] = []
        try:
            for _ in range(batch_size + 1):
                over = self._settle(slots[pending], taken, retired, undo, sampler)
                if over.size == 0:
                    break
                positions = np.sort(pending[over])
                again = sampler.sample(positions.size, generator)
                ids[positions], slots[positions] = again.ids, again.slots
                probabilities[positions], weights[positions] = again.probabilities, again.weights
                pending = positions
            else:
                raise EmptyTableError("draws could not be settled")  # unreachable in practice
        except EmptyTableError:
            for unique, take in taken:
                self._counts[unique] -= take.astype(np.uint32)
            for restore in reversed(undo):
                restore()
            generator.bit_generator.state = random_state
            raise
        done = np.concatenate(retired) if retired else np.empty(0, dtype=np.int64)
        self.retired += int(done.size)
        self.draws_left -= batch_size
        return SampleIndex(ids, slots, probabilities, weights), done

    def _settle(
        self,
        drawn: np.ndarray,
        taken: list[tuple[np.ndarray, np.ndarray]],
        retired: list[np.ndarray],
        undo: list[Callable[[], None]],
        sampler: Sampler,
    ) -> np.ndarray:
        """Count the draws ``drawn`` (slots, in batch order) up to each row's draws left.

        Returns the indices into ``drawn`` of the draws beyond them.
        """
        order = np.argsort(drawn, kind="stable")
        ordered = drawn[order]
        first = np.ones(ordered.size, dtype=bool)
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        unique = ordered[starts].astype(np.int64)
        sizes = np.diff(np.append(starts, ordered.size))
        left = np.maximum(self.limit - self._counts[unique].astype(np.int64), 0)
        take = np.minimum(sizes, left)
        self._counts[unique] += take.astype(np.uint32)
        taken.append((unique, take))
        done = unique[(take == left) & (take > 0)]
        if done.size:
            undo.append(sampler.remove(done))
            retired.append(done)
        rank = np.arange(ordered.size) - np.repeat(starts, sizes)
        return order[rank >= np.repeat(left, sizes)]

    def clear(self) -> None:
        """Every row was removed (reset)."""
        self.retired = 0
        self.draws_left = 0

    def state_dict(self, used: int) -> dict[str, Any]:
        counts = torch.from_numpy(self._counts[:used].astype(np.int64))
        return {"limit": self.limit, "counts": counts}

    def load_state_dict(self, state: dict[str, Any] | None, ring: IdRing) -> None:
        """Restore the counts (``None``: saved without a limit, so none drawn yet)."""
        if state is not None:
            if int(state["limit"]) != self.limit:
                raise ConfigError(
                    f"config says max_times_sampled={self.limit} but the saved state has "
                    f"max_times_sampled={int(state['limit'])}"
                )
            counts = state["counts"].numpy()
            self._counts.fill(0)
            self._counts[: counts.size] = counts
        live = self._counts[ring.slots(ring.range(ring.first_live, ring.size))].astype(np.int64)
        gone = live >= self.limit
        self.retired = int(gone.sum())
        self.draws_left = int((self.limit - live[~gone]).sum())


def load_retirement(
    retirement: Retirement | None, state: dict[str, Any] | None, ring: IdRing, table: str
) -> None:
    """Restore ``retirement`` from a saved table's ``times_sampled`` entry (``None``: absent).

    Raises:
        ConfigError: the saved ``max_times_sampled`` differs from the config's.
    """
    if retirement is None:
        if state is not None:
            raise ConfigError(
                f"table {table!r}: config says max_times_sampled=0 but the saved state has "
                f"max_times_sampled={int(state['limit'])}"
            )
        return
    try:
        retirement.load_state_dict(state, ring)
    except ConfigError as exc:
        raise ConfigError(f"table {table!r}: {exc}") from None
