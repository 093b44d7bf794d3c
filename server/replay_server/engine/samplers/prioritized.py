"""Proportional prioritized sampling (Schaul et al., 2016)."""

from __future__ import annotations

from typing import Any

import numpy as np

from replay_proto.mass import SamplingMass
from replay_server.errors import EmptyTableError
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import (
    InsertEvent,
    Removal,
    Sampler,
    SampleIndex,
    importance_weights,
    sorted_unit_draws,
)
from replay_server.engine.sampler_kinds import PRIORITIZED, PriorityOptions
from replay_server.engine.sumtree import SumTree


class PriorityState:
    """Per-table priority bookkeeping shared by the prioritized samplers.

    Holds ``alpha``, ``beta`` and the largest priority seen so far (at insert or
    update; 1.0 before any), which is what a new row without a priority gets.
    """

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha = alpha
        self.beta = beta
        self.max_priority = 1.0
        self._seen = False

    def given(self, priorities: np.ndarray | None, count: int) -> np.ndarray:
        """An insert's priorities: those given, else the largest seen so far for each row."""
        return np.full(count, self.max_priority) if priorities is None else priorities

    def observe(self, priorities: np.ndarray) -> None:
        if priorities.size:
            top = float(priorities.max())
            self.max_priority = top if not self._seen else max(self.max_priority, top)
            self._seen = True

    def mass(self, priorities: np.ndarray) -> np.ndarray:
        """Sampling mass ``p ** alpha`` (float32, as the tree stores it)."""
        return np.power(priorities, self.alpha).astype(np.float32)

    def priorities(self, mass: np.ndarray) -> np.ndarray:
        """The priorities (float64) whose sampling mass is ``mass``.

        With ``alpha == 0`` every mass is 1 and the priorities are not kept: 1.0 is returned.
        """
        mass = np.asarray(mass, dtype=np.float64)
        return np.power(mass, 1.0 / self.alpha) if self.alpha > 0 else np.ones_like(mass)

    def set_exponents(self, alpha: float | None, beta: float | None,
                      masses: list[np.ndarray]) -> None:
        """Take new exponents; re-express each array of ``masses`` (``p ** alpha``, float32,
        changed in place) with the new ``alpha``.

        From ``alpha == 0`` the priorities are not known, so the masses stay 1
        until each row's priority is next set (as TorchRL's ``PrioritizedSampler``).
        Cost: O(size of ``masses``).
        """
        if alpha is not None and alpha != self.alpha:
            if self.alpha > 0:
                for mass in masses:
                    np.power(mass, alpha / self.alpha, out=mass)
            self.alpha = float(alpha)
        if beta is not None:
            self.beta = float(beta)

    def state_dict(self) -> dict[str, Any]:
        return {"max_priority": self.max_priority, "seen": self._seen,
                "alpha": self.alpha, "beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_priority = float(state["max_priority"])
        self._seen = bool(state["seen"])
        # Exponents changed at run time (saved since they could be); else the config's.
        self.alpha = float(state.get("alpha", self.alpha))
        self.beta = float(state.get("beta", self.beta))


_SORTED_DRAWS_MIN = 4096


def draw_by_priority(
    tree: SumTree, batch_size: int, generator: np.random.Generator, beta: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch_size`` iid draws of slots with P(slot) = leaf / total.

    Returns:
        ``(slots int64, probabilities float64, importance weights float32)``.
    """
    total = tree.total()
    if batch_size < _SORTED_DRAWS_MIN:
        slots = tree.find(generator.random(batch_size) * total)
    else:  # sorted targets make the search of a large batch walk memory in order
        draws, order = sorted_unit_draws(generator, batch_size)
        slots = np.empty(batch_size, dtype=np.int64)
        slots[order] = tree.find(draws * total)
    probabilities = tree.get(slots) / total
    return slots, probabilities, importance_weights(probabilities, tree.min_positive() / total, beta)


class HoldsPriorities:
    """What a sampler keeping its priorities in a :class:`PriorityState` (``_prio``) tells
    of them; mixed in ahead of :class:`~replay_server.engine.samplers.base.Sampler`."""

    _prio: PriorityState

    @property
    def alpha(self) -> float:
        return self._prio.alpha

    @property
    def max_priority(self) -> float:
        return self._prio.max_priority


class PrioritizedSampler(HoldsPriorities, Sampler):
    """Row ``i`` is drawn with probability ``p_i^alpha / sum_k p_k^alpha``.

    Each row's mass lives in a :class:`~replay_server.engine.sumtree.SumTree` leaf at
    its slot. A new row's leaf is written exactly once, by the insert that
    stores it (overwriting the evicted row's leaf in the same write). A
    deleted row's leaf is 0; its :class:`~replay_server.engine.samplers.base.Removal`
    keeps the mass it had.

    Cost: ``sample`` O(B * log capacity); ``update``, ``insert``, ``delete``
    and ``restore`` O(n * log capacity) for n rows. Memory: 4 bytes per slot
    plus under 3 bytes of inner nodes and minima.
    """

    kind, traits, options = PRIORITIZED.kind, PRIORITIZED.traits, PRIORITIZED.options
    slot_bytes = staticmethod(PRIORITIZED.slot_bytes)

    def __init__(self, ring: IdRing, alpha: float, beta: float) -> None:
        super().__init__(ring)
        self._prio = PriorityState(alpha, beta)
        self._tree = SumTree(ring.capacity)

    @classmethod
    def build(cls, ring: IdRing, options: PriorityOptions, *,
              deletes: bool) -> PrioritizedSampler:
        return cls(ring, options.alpha, options.beta)

    def insert(self, event: InsertEvent) -> None:
        priorities = self._prio.given(event.priorities, event.count)
        self._prio.observe(priorities)
        self._tree.set(self._ring.slots(event.ids), self._prio.mass(priorities))

    def update(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        self._prio.observe(priorities)
        self._tree.set(self._ring.slots(positions), self._prio.mass(priorities))

    def priorities(self, positions: np.ndarray) -> np.ndarray:
        return self._prio.priorities(self._tree.get(self._ring.slots(positions)))

    def set_exponents(self, alpha: float | None, beta: float | None) -> tuple[float, float]:
        """New exponents; every leaf's mass re-expressed with the new ``alpha`` (O(capacity)).
        Rows a remover holds keep the mass they had (drawn again with it once restored)."""
        used = self._used
        if alpha is not None and alpha != self._prio.alpha and used:
            slots = np.arange(used, dtype=np.int64)
            leaves = self._tree.get(slots).astype(np.float32)
            self._prio.set_exponents(alpha, beta, [leaves])
            self._tree.set(slots, leaves)
        else:
            self._prio.set_exponents(alpha, beta, [])
        return self._prio.alpha, self._prio.beta

    def delete(self, positions: np.ndarray) -> Removal:
        """Zero the rows' sampling mass; the removal keeps it."""
        slots = self._ring.slots(positions)
        mass = self._tree.get(slots)
        self._tree.set(slots, np.zeros(slots.size, dtype=np.float32))
        return Removal(positions, mass)

    def restore(self, removal: Removal) -> None:
        assert removal.values is not None
        live = self._ring.live(removal.positions)
        self._tree.set(self._ring.slots(removal.positions[live]), removal.values[live])

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        total = self._tree.total()
        if self._ring.size == 0:
            raise EmptyTableError("the table is empty")
        if total <= 0.0:
            raise EmptyTableError("every row has priority 0, so none can be drawn")
        slots, probabilities, weights = draw_by_priority(
            self._tree, batch_size, generator, self._prio.beta
        )
        return SampleIndex(self._ring.ids_of_slots(slots), slots, probabilities, weights)

    def clear(self) -> None:
        self._tree.clear()

    def mass(self) -> SamplingMass:
        return SamplingMass(self._tree.total(), self._tree.min_positive(), self._ring.size)

    def stats(self) -> dict[str, Any]:
        return {"max_priority": self._prio.max_priority, "priority_mass": self._tree.total(),
                "alpha": self._prio.alpha, "beta": self._prio.beta}

    def state_dict(self) -> dict[str, Any]:
        return {"priority": self._prio.state_dict(), "tree": self._tree.state_dict(self._used)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prio.load_state_dict(state["priority"])
        self._tree.load_state_dict(state["tree"])
