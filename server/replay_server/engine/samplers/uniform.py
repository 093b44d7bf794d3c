"""Uniform sampling over the rows present."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_proto.mass import SamplingMass, uniform_mass
from replay_server.errors import EmptyTableError
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import (
    InsertEvent,
    Removal,
    Sampler,
    SampleIndex,
    SamplerSpec,
    uniform_draws,
)
from replay_server.engine.samplers.slotset import SlotSet
from replay_server.engine.sampler_kinds import UNIFORM


class UniformSampler(Sampler):
    """Every drawable row is drawn with probability ``1 / drawable``.

    The rows present are exactly the positions ``[first_live, next_id)`` (see
    :mod:`replay_server.engine.ids`), so sampling draws integers in that range and
    needs no per-row state at all.

    In a table that deletes rows (one with a remover: ``max_times_sampled``),
    the drawable rows are kept in a
    :class:`~replay_server.engine.samplers.slotset.SlotSet` instead.

    Cost: ``sample`` O(B); ``insert``/``clear`` O(1), or O(n) for n rows once
    rows are deleted; ``delete``/``restore`` O(n). Memory: none per slot, or
    8 bytes per slot in a table that deletes (16 past 2**31 slots).
    """

    kind, traits, options = UNIFORM.kind, UNIFORM.traits, UNIFORM.options
    slot_bytes = staticmethod(UNIFORM.slot_bytes)

    def __init__(self, ring: IdRing) -> None:
        super().__init__(ring)
        self._members: SlotSet | None = None

    @classmethod
    def build(cls, ring: IdRing, options: SamplerSpec, *, deletes: bool) -> UniformSampler:
        sampler = cls(ring)
        if deletes:
            sampler._member_set()
        return sampler

    def _member_set(self) -> SlotSet:
        """The drawable rows as a set, made from the live range when first needed."""
        if self._members is None:
            ring = self._ring
            self._members = SlotSet(ring.capacity)
            self._members.add(ring.slots(ring.range(ring.first_live, ring.size)))
        return self._members

    def insert(self, event: InsertEvent) -> None:
        if self._members is not None:
            if event.evicted:
                self._members.remove(self._ring.slots(event.evicted_ids))
            self._members.add(self._ring.slots(event.ids))

    def update(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities do not change uniform draws (the table refuses them first)."""

    def delete(self, positions: np.ndarray) -> Removal:
        self._member_set().remove(self._ring.slots(positions))
        return Removal(positions)

    def restore(self, removal: Removal) -> None:
        members = self._member_set()
        slots = self._ring.slots(removal.positions[self._ring.live(removal.positions)])
        members.add(slots[~members.contains(slots)])

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
        """Take the drawable rows (saved by a table that never deleted: every live row)."""
        if self._members is None and "members" not in state:
            return
        if self._members is not None:
            self._members = None  # rebuilt below from the live range, or filled from the state
        members = self._member_set()
        if "members" in state:
            members.clear()
            members.add(state["members"].numpy())
