"""Slot sets: which slots may be drawn, when that is not a contiguous range of ids.

Used for the valid slice starts of :class:`~replay_server.engine.samplers.slice.SliceSampler`
and for the drawable rows of a uniform table that deletes rows (one with a remover).

Not thread-safe: called under the table's lock.
"""

from __future__ import annotations

import numpy as np

from replay_server.engine.samplers.base import uniform_draws
from replay_server.engine.slot_memory import index_dtype


class SlotSet:
    """A set of slots with O(1) membership and O(B) uniform draws.

    Dense array of members plus each slot's position in it; removal moves the
    last members into the holes (vectorized for a batch of removals).
    Memory: 8 bytes per slot (4 when capacity < 2**31).
    """

    def __init__(self, capacity: int) -> None:
        dtype = index_dtype(capacity)
        self._pos = np.full(capacity, -1, dtype=dtype)
        self._dense = np.zeros(capacity, dtype=dtype)
        self.count = 0

    def add(self, slots: np.ndarray) -> None:
        """Add ``slots``: distinct, and none of them a member already."""
        k = slots.size
        self._pos[slots] = np.arange(self.count, self.count + k)
        self._dense[self.count : self.count + k] = slots
        self.count += k

    def contains(self, slots: np.ndarray) -> np.ndarray:
        """Bool mask: which of ``slots`` are members."""
        return self._pos[slots] >= 0

    def remove(self, slots: np.ndarray) -> None:
        """Remove those of ``slots`` that are members."""
        positions = self._pos[slots]
        member = positions >= 0
        slots, positions = slots[member], positions[member]
        k = slots.size
        if k == 0:
            return
        new_count = self.count - k
        self._pos[slots] = -1
        holes = positions[positions < new_count]
        tail = self._dense[new_count : self.count]
        fillers = tail[self._pos[tail] >= 0]
        self._dense[holes] = fillers
        self._pos[fillers] = holes
        self.count = new_count

    def draw(self, batch_size: int, generator: np.random.Generator) -> np.ndarray:
        return self._dense[uniform_draws(generator, self.count, batch_size)]

    def members(self) -> np.ndarray:
        return self._dense[: self.count]

    def clear(self) -> None:
        self._pos[self._dense[: self.count]] = -1
        self.count = 0
