"""Uniform sampling over the rows present."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replay_proto.mass import SamplingMass, uniform_mass
from replay_server.errors import EmptyTableError
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import (
    InsertEvent,
    Sampler,
    SampleIndex,
    SamplerTraits,
    uniform_draws,
)
from replay_server.engine.samplers.slotset import SlotSet


class UniformSampler(Sampler):
    """Every present row is drawn with probability ``1 / size``.

    The rows present are exactly the ids ``[first_live, next_id)`` (see
    :mod:`replay_server.engine.ids`), so sampling draws integers in that range and
    needs no per-row state at all.

    With ``retiring`` (a table with ``max_times_sampled``), rows can also be
    removed one by one, so the drawable rows are kept in a
    :class:`~replay_server.engine.samplers.slotset.SlotSet` instead.

    Cost: ``sample`` O(B); ``insert``/``clear`` O(1), or O(n) for n rows when
    retiring. Memory: none per row, or 8 bytes per slot when retiring.
    """

    traits = SamplerTraits()

    def __init__(self, ring: IdRing, retiring: bool = False) -> None:
        super().__init__(ring)
        self._members = SlotSet(ring.capacity) if retiring else None

    def insert(self, event: InsertEvent) -> None:
        if self._members is not None:
            if event.evicted:
                self._members.remove(self._ring.slots(event.evicted_ids))
            self._members.add(self._ring.slots(event.ids))

    def remove(self, slots: np.ndarray) -> Callable[[], None]:
        if self._members is None:
            return super().remove(slots)
        self._members.remove(slots)
        return lambda: self._members.add(slots)  # type: ignore[union-attr]

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        if self._members is not None:
            return self._sample_members(batch_size, generator)
        size = self._ring.size
        if size == 0:
            raise EmptyTableError("the table is empty")
        ids = uniform_draws(generator, size, batch_size) + self._ring.first_live
        return SampleIndex(
            ids=ids,
            slots=self._ring.slots(ids),
            probabilities=np.full(batch_size, 1.0 / size),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def _sample_members(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        assert self._members is not None
        count = self._members.count
        if count == 0:
            raise EmptyTableError("the table is empty")
        slots = self._members.draw(batch_size, generator).astype(np.int64)
        return SampleIndex(
            ids=self._ring.ids_of_slots(slots),
            slots=slots,
            probabilities=np.full(batch_size, 1.0 / count),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def clear(self) -> None:
        if self._members is not None:
            self._members.clear()

    def mass(self) -> SamplingMass:
        return uniform_mass(self._ring.size if self._members is None else self._members.count)

    def stats(self) -> dict[str, Any]:
        return {} if self._members is None else {"drawable": self._members.count}

    def state_dict(self) -> dict[str, Any]:
        if self._members is None:
            return {}
        return {"members": torch.from_numpy(self._members.members().astype(np.int64))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._members is not None:
            self._members.clear()
            if "members" in state:
                self._members.add(state["members"].numpy())
            else:  # saved without max_times_sampled: every live row is drawable
                ring = self._ring
                self._members.add(ring.slots(ring.range(ring.first_live, ring.size)))
