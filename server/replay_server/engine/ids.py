"""Row ids: what names a row everywhere outside the table.

A row's id is its insertion number in the table: the n-th row ever inserted
gets id ``n`` (ids keep counting across ``reset``, so none is ever reused).
The id encodes where the row lives and which occupant of that place it is::

    slot = id % capacity          generation = id // capacity

Because the ring overwrites rows in insertion order, the rows present are
exactly the ids in ``[first_live, next_id)``. So an id is stale (its slot now
holds a newer row, or the table was reset) iff it is below ``first_live``,
which is an O(1) check needing no per-row memory.
"""

from __future__ import annotations

import numpy as np


class IdRing:
    """The table's id counters and the id <-> slot arithmetic.

    Owned and mutated only by its table, under the table's lock; samplers read it.
    """

    __slots__ = ("capacity", "next_id", "first_live", "base")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.next_id = 0
        self.first_live = 0
        self.base = 0
        """The first id since the last :meth:`clear` (a multiple of the capacity; 0 if none)."""

    @property
    def used(self) -> int:
        """Slots written since the last clear: the prefix ``0 .. used - 1`` of per-slot
        state worth keeping (what a reset left in the other slots is dead)."""
        return min(self.next_id - self.base, self.capacity)

    @property
    def size(self) -> int:
        """Rows present."""
        return self.next_id - self.first_live

    def range(self, first: int, count: int) -> np.ndarray:
        """The ids ``first .. first + count - 1`` (int64)."""
        return np.arange(first, first + count, dtype=np.int64)

    def allocate(self, n: int) -> tuple[int, int]:
        """Issue ids for ``n`` new rows (``n <= capacity``).

        Returns:
            ``(first_id, evicted)``: the new ids are ``first_id .. first_id + n - 1``;
            the ``evicted`` oldest rows (ids from the old ``first_live`` on) are
            overwritten by them.
        """
        first_id = self.next_id
        self.next_id += n
        evicted = max(0, self.next_id - self.first_live - self.capacity)
        self.first_live += evicted
        return first_id, evicted

    def clear(self) -> None:
        """Forget all rows; ids keep counting, from the next multiple of the capacity, so
        the first row after a reset goes to slot 0 again (storage positions start over,
        as TorchRL's do after ``empty()``; the skipped ids are never issued)."""
        self.next_id = -(-self.next_id // self.capacity) * self.capacity
        self.first_live = self.base = self.next_id

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids`` (int64, any shape)."""
        return ids % self.capacity

    def live(self, ids: np.ndarray) -> np.ndarray:
        """Bool mask: which ``ids`` name rows still present."""
        return (ids >= self.first_live) & (ids < self.next_id)

    def ids_of_slots(self, slots: np.ndarray) -> np.ndarray:
        """Ids (int64) of the rows now in ``slots`` (all of which must hold a live row)."""
        return self.first_live + (slots.astype(np.int64) - self.first_live) % self.capacity

    def state_dict(self) -> dict[str, int]:
        return {"next_id": self.next_id, "first_live": self.first_live, "base": self.base}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (one saved before ``base`` existed has 0: its resets never
        moved the ids to a multiple of the capacity)."""
        next_id, first_live = int(state["next_id"]), int(state["first_live"])
        base = int(state.get("base", 0))
        if (not 0 <= base <= first_live <= next_id or next_id - first_live > self.capacity
                or base % self.capacity):
            raise ValueError(f"inconsistent id counters: base={base}, first_live={first_live}, "
                             f"next_id={next_id}")
        self.next_id, self.first_live, self.base = next_id, first_live, base
