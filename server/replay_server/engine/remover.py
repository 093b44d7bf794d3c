"""The remover: rows leave the table after ``limit`` draws, and no batch over-draws a row.

Reverb gives every table a remover beside its sampler; here the ring already
evicts the oldest rows, so the remover's one job is the rows that leave
*because they were sampled*: a table with ``max_times_sampled = k`` (limit
``k``), and every table whose sampler consumes its rows (``fifo``/``lifo``:
limit 1, or ``max_times_sampled`` when given). That is all a queue is: an
ordered sampler plus a remover.

The remover counts how often each stored row has been returned. A row
returned ``limit`` times is *retired*: the sampler stops drawing it
(:meth:`~replay_server.engine.samplers.base.Sampler.delete`), it no longer
counts in the table's size, priority updates for it are ignored as stale,
and it stays stored until the ring overwrites it. For the rate limiter a
retirement is a delete, as in Reverb. ``Table.delete`` retires rows at once.

With a slice sampler the remover counts *slices*, as Reverb counts its items
(which are sequences): each draw counts for the slice's first step, and a
slice drawn ``limit`` times is retired, its start no longer drawn; its rows
stay (they belong to up to ``slice_len`` overlapping slices, the others still
drawable), so the table's size and the rate limiter's deletes do not change
(:attr:`Remover.removes_rows` is False).

Draws within a batch may repeat a row (samplers draw with replacement), so
a batch may draw a row more often than it has draws left. :meth:`Remover.sample`
settles draws in batch order: a row keeps its first ``limit - count`` draws,
and the others are drawn again among the rows still drawable, until every
draw is settled. Each round that leaves draws unsettled retires at least one
row, so there are at most ``batch_size`` rounds (almost always one; an
ordered sampler never repeats a row, so always one).

Rows *taken but not acknowledged* (a lease, which a later layer may add) are
rows whose draws are counted and whose :class:`~replay_server.engine.samplers.base.Removal`
is kept: :meth:`Remover.give_back` returns them to the sampler and uncounts
the draws, as a failed sample's draws are given back here.

Memory: one count per slot (uint8 while ``limit < 256``, else uint16 or
uint32). Cost: ``inserted`` O(n) for n rows; ``sample`` O(B log B) per
round plus the sampler's draws and deletes. Not thread-safe: called under
the table's lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_server.engine.ids import IdRing
from replay_server.engine.slot_memory import count_dtype, remover_slot_bytes
from replay_server.engine.samplers import Removal, Sampler, SampleIndex
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    RateLimitedError,
)


class Remover:
    """Per-row draw counts of a table whose rows leave when sampled (see the module docstring).

    Args:
        ring: the table's id ring (positions; read only).
        limit: draws a row may be handed out (>= 1).
        removes_rows: retiring removes the row (row samplers); ``False``: it
            only retires the slice that starts at it (slice samplers).

    Attributes:
        retired: rows stored but retired.
        draws_left: draws the stored, unretired rows have left, together.
    """

    def __init__(self, ring: IdRing, limit: int, *, removes_rows: bool = True) -> None:
        self.limit = limit
        self.removes_rows = removes_rows
        self._ring = ring
        self._counts = np.zeros(ring.capacity, dtype=count_dtype(limit))
        self.retired = 0
        self.draws_left = 0

    @staticmethod
    def slot_bytes(limit: int) -> int:
        """Bytes per slot of a remover of ``limit``."""
        return remover_slot_bytes(limit)

    @property
    def rows_gone(self) -> int:
        """Rows stored that no longer count in the table's size (retired rows; 0 when
        retiring a slice leaves its rows)."""
        return self.retired if self.removes_rows else 0

    def drawable(self, positions: np.ndarray) -> np.ndarray:
        """Bool mask: which of ``positions`` (of live rows) are not retired."""
        return self._counts[self._ring.slots(positions)] < self.limit

    def inserted(self, positions: np.ndarray, evicted: np.ndarray) -> int:
        """New rows went in at ``positions``, overwriting the rows at positions ``evicted``.

        Returns:
            How many of the overwritten rows had already retired and left the
            table (their delete was counted when they retired).
        """
        retired_gone = 0
        if evicted.size:
            counts = self._counts[self._ring.slots(evicted)].astype(np.int64)
            gone = counts >= self.limit
            retired_gone = int(gone.sum())
            self.retired -= retired_gone
            self.draws_left -= int((self.limit - counts[~gone]).sum())
        self._counts[self._ring.slots(positions)] = 0
        self.draws_left += self.limit * int(positions.size)
        return retired_gone if self.removes_rows else 0

    def check_sample(self, batch_size: int, table: str, *, can_wait: bool,
                     distinct: bool) -> None:
        """Raise unless the rows left can give ``batch_size`` draws; change nothing.

        ``distinct``: the sampler draws distinct rows (an ordered one), so the
        batch needs ``batch_size`` drawable rows, not draws.

        Raises:
            InvalidArgumentError: more than a full table can ever give.
            RateLimitedError: (``can_wait``, a table with a rate limiter) too
                few left now; inserts will add more.
            EmptyTableError: (no rate limiter) too few left now.
        """
        capacity = self._counts.size
        most = capacity if distinct else capacity * self.limit
        if batch_size > most:
            raise InvalidArgumentError(
                f"table {table!r}: a sample of {batch_size} rows can never be served: "
                + (f"a batch takes distinct rows and the table holds at most {capacity}"
                   if distinct else
                   f"capacity={capacity} rows of max_times_sampled={self.limit} draws each "
                   f"allow at most {most}"))
        have = self._ring.size - self.retired if distinct else self.draws_left
        if batch_size > have:
            why = (f"the table holds {have} rows that can still be handed out and a sample "
                   f"takes {batch_size}" if distinct else
                   f"a sample of {batch_size} rows needs more draws than the rows stored have "
                   f"left ({have}) before they reach max_times_sampled={self.limit}")
            if can_wait:
                raise RateLimitedError(f"table {table!r}: {why}; it waits for inserts",
                                       table=table, operation="sample", count=batch_size)
            raise EmptyTableError(f"{why}; insert more rows")  # the table names itself

    def sample(
        self, sampler: Sampler, batch_size: int, generator: np.random.Generator, table: str,
        *, can_wait: bool,
    ) -> tuple[SampleIndex, list[Removal]]:
        """Draw a batch in which no row exceeds its draws left; retire rows that reach the limit.

        Returns:
            The batch, and the removals of the rows it retired (distinct rows).

        Raises:
            InvalidArgumentError, RateLimitedError, EmptyTableError: as
                :meth:`check_sample`; or EmptyTableError when the rows that
                can still be drawn ran out (e.g. the others have priority 0).
                The counts, the sampler and the generator are then as before.
        """
        distinct = sampler.traits.ordered
        self.check_sample(batch_size, table, can_wait=can_wait, distinct=distinct)
        random_state = generator.bit_generator.state
        index = sampler.sample(batch_size, generator)
        ids, slots = index.ids, index.slots
        probabilities, weights = index.probabilities, index.weights
        pending = np.arange(batch_size)
        taken: list[tuple[np.ndarray, np.ndarray]] = []
        removals: list[Removal] = []
        try:
            for _ in range(batch_size + 1):
                over = self._settle(_first(slots[pending]), taken, removals, sampler)
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
                self._counts[unique] -= take.astype(self._counts.dtype)
            for removal in reversed(removals):
                sampler.restore(removal)
            generator.bit_generator.state = random_state
            raise
        self.retired += sum(removal.positions.size for removal in removals)
        self.draws_left -= batch_size
        return SampleIndex(ids, slots, probabilities, weights), removals

    def _settle(
        self,
        drawn: np.ndarray,
        taken: list[tuple[np.ndarray, np.ndarray]],
        removals: list[Removal],
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
        self._counts[unique] += take.astype(self._counts.dtype)
        taken.append((unique, take))
        done = unique[(take == left) & (take > 0)]
        if done.size:
            removals.append(sampler.delete(self._ring.ids_of_slots(done)))
        rank = np.arange(ordered.size) - np.repeat(starts, sizes)
        return order[rank >= np.repeat(left, sizes)]

    def delete(self, sampler: Sampler, positions: np.ndarray) -> int:
        """Retire the rows at ``positions`` (live, distinct) at once, those not retired yet.

        Returns:
            How many were retired now (the others had retired before).
        """
        positions = positions[self.drawable(positions)]
        if positions.size:
            slots = self._ring.slots(positions)
            sampler.delete(positions)
            self.draws_left -= int((self.limit - self._counts[slots].astype(np.int64)).sum())
            self._counts[slots] = self.limit
            self.retired += int(positions.size)
        return int(positions.size)

    def give_back(self, sampler: Sampler, removal: Removal) -> int:
        """Return retired rows to the sampler with all their draws left (those still live).

        What a lease's expiry does (a later layer): the rows of ``removal``
        (as :meth:`sample` returned it) may be drawn again. The remover knows
        which rows are retired, not who took them: a lease gives back only
        rows it still holds. Returns how many came back.
        """
        live = removal.positions[self._ring.live(removal.positions)]
        slots = self._ring.slots(live)
        back = live[self._counts[slots] >= self.limit]
        if back.size:
            sampler.restore(Removal(back, None if removal.values is None else
                                    removal.values[np.isin(removal.positions, back)]))
            self._counts[self._ring.slots(back)] = 0
            self.retired -= int(back.size)
            self.draws_left += self.limit * int(back.size)
        return int(back.size)

    def clear(self) -> None:
        """Every row was removed (reset)."""
        self.retired = 0
        self.draws_left = 0

    def state_dict(self, used: int) -> dict[str, Any]:
        counts = torch.from_numpy(self._counts[:used].astype(np.int64))
        return {"limit": self.limit, "counts": counts}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the counts (``None``: saved without a limit, so none drawn yet)."""
        if state is not None:
            if int(state["limit"]) != self.limit:
                raise ConfigError(
                    f"config says max_times_sampled={self.limit} but the saved state has "
                    f"max_times_sampled={int(state['limit'])}"
                )
            counts = state["counts"].numpy()
            if counts.size and (counts.min() < 0 or counts.max() > self.limit):
                raise ValueError(f"draw counts outside [0, {self.limit}]")
            self._counts.fill(0)
            self._counts[: counts.size] = counts
        ring = self._ring
        live = self._counts[ring.slots(ring.range(ring.first_live, ring.size))].astype(np.int64)
        gone = live >= self.limit
        self.retired = int(gone.sum())
        self.draws_left = int((self.limit - live[~gone]).sum())


def _first(slots: np.ndarray) -> np.ndarray:
    """What a draw counts for: the row, or a slice's first step."""
    return slots if slots.ndim == 1 else slots[:, 0]


def load_remover(remover: Remover | None, state: dict[str, Any] | None, table: str) -> None:
    """Restore ``remover`` from a saved table's ``times_sampled`` entry (``None``: absent).

    Raises:
        ConfigError: the saved limit differs from the config's.
    """
    if remover is None:
        if state is not None:
            raise ConfigError(
                f"table {table!r}: config says max_times_sampled=0 but the saved state has "
                f"max_times_sampled={int(state['limit'])}"
            )
        return
    try:
        remover.load_state_dict(state)
    except ConfigError as exc:
        raise ConfigError(f"table {table!r}: {exc}") from None
