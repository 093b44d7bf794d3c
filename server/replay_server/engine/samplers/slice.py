"""Slice samplers: batches of ``[B, slice_len]`` consecutive steps of one episode each.

Both are built on :class:`~replay_server.engine.samplers.episodes.EpisodeIndex`, which
yields each row the moment it becomes a valid slice start; they differ only in
how a start is drawn: uniformly (:class:`SliceSampler`) or by priority
(:class:`PrioritizedSliceSampler`, R2D2-style sequence replay). Sampling cost
depends on neither capacity nor the number of rows stored.

*Partial slices* (the table's ``strict_length = false`` or a span, see
:class:`~replay_server.engine.config.TableConfig`) may be shorter than
``slice_len``: they start at the first stored step of an episode of any length
(``strict_length = false``), may end up to ``span_right`` steps early at an
episode's last stored step, and (:class:`SliceSampler` only) may begin up to
``span_left`` steps before its first one. A sample is still ``[B, slice_len]``:
past a slice's last real step its window repeats that step's id (and row), so
``1 + number of id changes`` along a window is its length (what the clients
cut or pad, see ``replay_proto.slices``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_proto.mass import SamplingMass, uniform_mass
from replay_server.errors import EmptyTableError, InvalidPriorityError
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import (
    InsertEvent,
    Removal,
    Sampler,
    SampleIndex,
    uniform_draws,
)
from replay_server.engine.sampler_kinds import (
    PRIORITIZED_SLICE,
    SLICE,
    PrioritizedSliceOptions,
    SliceOptions,
)
from replay_server.engine.samplers.episodes import EpisodeIndex
from replay_server.engine.samplers.heads import EpisodeHeads
from replay_server.engine.samplers.prioritized import (
    HoldsPriorities,
    PriorityState,
    draw_by_priority,
)
from replay_server.engine.samplers.slotset import SlotSet
from replay_server.engine.snapshot import saved_copy
from replay_server.engine.sumtree import SumTree


def _no_slices(ring: IdRing, episodes: EpisodeIndex) -> EmptyTableError:
    if ring.size == 0:
        return EmptyTableError("the table is empty")
    return EmptyTableError(
        f"no episode has {episodes.min_len} consecutive steps stored yet "
        f"({ring.size} rows stored); episodes shorter than slice_len = "
        f"{episodes.slice_len} are sampled only by a table with strict_length = false"
    )


def _fresh(slots: np.ndarray, is_start: np.ndarray | None, starts: SlotSet | None = None
           ) -> np.ndarray:
    """``slots`` that are not starts yet, each once (partial slices: an episode's first
    step may come back as a start when it later has ``min_len`` steps)."""
    slots = np.unique(slots)
    if starts is not None:
        known = starts.contains(slots)
    else:
        assert is_start is not None, "a slot set or a start mask"
        known = is_start[slots]
    return slots[~known]


def _new_starts(ring: IdRing, episodes: EpisodeIndex, event: InsertEvent,
                strict_length: bool) -> tuple[np.ndarray, np.ndarray]:
    """Partial slices: the slots that may have become starts (with duplicates, and starts
    already known), and the slots of the new episode heads."""
    starts, heads = episodes.insert_tracking_heads(event)
    starts, heads = ring.slots(starts), ring.slots(heads)
    return (starts if strict_length else np.concatenate((starts, heads))), heads


def _cut(windows: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``windows`` ``[n, slice_len]`` with at most ``keep[i]`` real steps each, the rest
    repeating the last one kept (see :mod:`replay_server.engine.samplers.episodes`)."""
    real = 1 + (windows[:, 1:] != windows[:, :-1]).sum(axis=1)
    last = np.minimum(real, keep) - 1
    steps = np.minimum(np.arange(windows.shape[1]), last[:, None])
    return np.take_along_axis(windows, steps, axis=1)


class SliceSampler(Sampler):
    """Slices whose starts are drawn uniformly among all valid starts (and, with a left
    span, the windows that begin before an episode's first step: see
    :mod:`~replay_server.engine.samplers.heads`).

    Cost: ``sample`` O(B * slice_len); ``insert`` O(n) for n rows (see
    :class:`~replay_server.engine.samplers.episodes.EpisodeIndex`); ``delete``
    and ``restore`` O(n). Memory: 12 bytes per slot (24 when capacity >= 2**31),
    9 (17) more with ``span_left``.
    """

    kind, traits, options = SLICE.kind, SLICE.traits, SLICE.options
    slot_bytes = staticmethod(SLICE.slot_bytes)

    def __init__(self, ring: IdRing, slice_len: int, *, strict_length: bool = True,
                 span_left: int = 0, span_right: int = 0) -> None:
        super().__init__(ring)
        self._episodes = EpisodeIndex(ring, slice_len, slice_len - span_right)
        self._strict = strict_length
        self._partial = not strict_length or span_left > 0 or span_right > 0
        self._left = span_left
        self._heads = EpisodeHeads(ring.capacity) if span_left else None
        self._starts = SlotSet(ring.capacity)

    @classmethod
    def build(cls, ring: IdRing, options: SliceOptions, *, deletes: bool) -> SliceSampler:
        assert options.slice_len is not None
        return cls(ring, options.slice_len, strict_length=options.strict_length,
                   span_left=options.span_left, span_right=options.span_right)

    def insert(self, event: InsertEvent) -> None:
        cap = self._ring.capacity
        if event.evicted:
            evicted = event.evicted_ids % cap
            self._starts.remove(evicted)
            if self._heads is not None:
                self._heads.evict(evicted)
        if not self._partial:
            self._starts.add(self._episodes.insert(event) % cap)
            return
        candidates, heads = _new_starts(self._ring, self._episodes, event, self._strict)
        new = _fresh(candidates, None, self._starts)
        self._starts.add(new)
        if self._heads is not None:
            self._heads.arrived(heads, new, self._starts)

    def update(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities do not change uniform draws (the table refuses them first)."""

    def delete(self, positions: np.ndarray) -> Removal:
        """Stop drawing the slices that start at ``positions``."""
        slots = self._ring.slots(positions)
        starts = self._starts.contains(slots)
        self._starts.remove(slots[starts])
        if self._heads is not None:
            self._heads.drawable.remove(slots)
        return Removal(positions, starts)

    def restore(self, removal: Removal) -> None:
        assert removal.values is not None
        positions = removal.positions[removal.values & self._ring.live(removal.positions)]
        slots = self._ring.slots(positions)
        self._starts.add(slots[~self._starts.contains(slots)])
        if self._heads is not None:
            self._heads.restore(slots, self._starts)

    def _draws(self) -> int:
        """Windows a draw picks among: every start's, and ``span_left`` more per head."""
        heads = 0 if self._heads is None else self._heads.drawable.count
        return self._starts.count + self._left * heads

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        n = self._starts.count
        if n == 0:
            raise _no_slices(self._ring, self._episodes)
        total = self._draws()
        if total == n:
            slots = self._episodes.chain(self._starts.draw(batch_size, generator))
        else:
            slots = self._draw_with_left_windows(batch_size, generator, total)
        return SampleIndex(
            ids=self._ring.ids_of_slots(slots),
            slots=slots,
            probabilities=np.full(batch_size, 1.0 / total),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def _draw_with_left_windows(self, batch_size: int, generator: np.random.Generator,
                                total: int) -> np.ndarray:
        """Draws over ``starts + span_left * heads``: a draw past the starts is the window
        of a head shifted ``1 + k // heads`` steps left, cut to what remains of it."""
        assert self._heads is not None
        n, heads = self._starts.count, self._heads.drawable
        draws = uniform_draws(generator, total, batch_size)
        early = draws >= n
        first = np.empty(batch_size, dtype=np.int64)
        first[~early] = self._starts.members()[draws[~early]]
        k = draws[early] - n
        first[early] = heads.members()[k % heads.count]
        slots = self._episodes.chain(first)
        slots[early] = _cut(slots[early], self._episodes.slice_len - 1 - k // heads.count)
        return slots

    def clear(self) -> None:
        self._episodes.clear()
        self._starts.clear()
        if self._heads is not None:
            self._heads.clear()

    def mass(self) -> SamplingMass:
        return uniform_mass(self._draws())

    def stats(self) -> dict[str, Any]:
        return {"slices": self._starts.count, "open_episodes": self._episodes.open_episodes}

    def state_dict(self) -> dict[str, Any]:
        state = {
            "episodes": self._episodes.state_dict(self._used),
            "starts": torch.from_numpy(saved_copy(self._starts.members(), np.int64)),
        }
        if self._heads is not None:
            state["heads"] = self._heads.state_dict(self._used)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._episodes.load_state_dict(state["episodes"])
        self._starts.clear()
        self._starts.add(state["starts"].numpy())
        if self._heads is not None:
            self._heads.load_state_dict(state["heads"])


class PrioritizedSliceSampler(HoldsPriorities, Sampler):
    """Slices whose starts are drawn by priority: P(slice at row i) ∝ p_i^alpha.

    Every row has a priority (given at insert, else the largest seen so far,
    updated through its id); only rows that are valid starts carry sampling
    mass. The priority of a slice is the priority of its first row, so a
    learner updates with ``batch.ids[:, 0]`` (updating other rows is allowed
    and takes effect when those rows start a slice). Importance weights use
    N = number of valid starts.

    Cost: ``sample`` O(B * (log capacity + slice_len)); ``insert``,
    ``update``, ``delete`` and ``restore`` O(n * log capacity). Memory: 16
    bytes per slot (20 when capacity >= 2**31).
    """

    kind, traits = PRIORITIZED_SLICE.kind, PRIORITIZED_SLICE.traits
    options = PRIORITIZED_SLICE.options
    slot_bytes = staticmethod(PRIORITIZED_SLICE.slot_bytes)

    @classmethod
    def build(cls, ring: IdRing, options: PrioritizedSliceOptions, *,
              deletes: bool) -> PrioritizedSliceSampler:
        assert options.slice_len is not None
        return cls(ring, options.slice_len, options.alpha, options.beta,
                   options.priority_mixing, strict_length=options.strict_length,
                   span_right=options.span_right)

    def __init__(self, ring: IdRing, slice_len: int, alpha: float, beta: float,
                 mixing: float | None = None, *, strict_length: bool = True,
                 span_right: int = 0) -> None:
        super().__init__(ring)
        cap = ring.capacity
        self._mixing = mixing
        self._episodes = EpisodeIndex(ring, slice_len, slice_len - span_right)
        self._strict = strict_length
        self._partial = not strict_length or span_right > 0
        self._prio = PriorityState(alpha, beta)
        self._tree = SumTree(cap)
        self._row_mass = np.zeros(cap, dtype=np.float32)
        self._is_start = np.zeros(cap, dtype=bool)
        self._num_starts = 0

    def insert(self, event: InsertEvent) -> None:
        cap = self._ring.capacity
        if event.evicted:
            evicted = self._ring.slots(event.evicted_ids)
            gone = evicted[self._is_start[evicted]]
            self._tree.set(gone, np.zeros(gone.size, dtype=np.float32))
            self._is_start[gone] = False
            self._num_starts -= int(gone.size)
        priorities = self._prio.given(event.priorities, event.count)
        self._prio.observe(priorities)
        self._row_mass[self._ring.slots(event.ids)] = self._prio.mass(priorities)
        if self._partial:
            new = _fresh(_new_starts(self._ring, self._episodes, event, self._strict)[0], self._is_start)
        else:
            new = self._episodes.insert(event) % cap
        self._is_start[new] = True
        self._tree.set(new, self._row_mass[new])
        self._num_starts += int(new.size)

    def priorities(self, positions: np.ndarray) -> np.ndarray:
        return self._prio.priorities(self._row_mass[self._ring.slots(positions)])

    def set_exponents(self, alpha: float | None, beta: float | None) -> tuple[float, float]:
        """New exponents; every row's mass re-expressed with the new ``alpha`` (O(capacity))."""
        used = self._used
        self._prio.set_exponents(alpha, beta, [self._row_mass[:used]])
        starts = np.flatnonzero(self._is_start[:used])
        self._tree.set(starts, self._row_mass[starts])
        return self._prio.alpha, self._prio.beta

    def update(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        """Rows' priorities (``[n]``), or, with ``priority_mixing``, whole slices' (``[B,
        slice_len]``: each row one slice as sampled, its start given the mix).

        Raises:
            InvalidPriorityError: (slices) a row is not a slice as sampled; nothing changed.
        """
        if positions.ndim == 2:
            positions, priorities = self._mixed(positions, priorities)
        self._prio.observe(priorities)
        mass = self._prio.mass(priorities)
        slots = self._ring.slots(positions)
        self._row_mass[slots] = mass  # a repeated id keeps its last priority (see SumTree.set)
        starts = slots[self._is_start[slots]]
        self._tree.set(starts, self._row_mass[starts])

    def _mixed(self, slices: np.ndarray, per_step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each slice's start and ``eta * max + (1 - eta) * mean`` of its steps' priorities
        (R2D2's mixing, Kapturowski et al. 2019), once every row is checked to be the slice
        a draw of its start returns: its ``slice_len`` steps, in order. So ids grouped
        otherwise (time-major, a subset of steps, slices of two batches interleaved) are
        refused rather than mixed into the wrong start. Cost: O(B * slice_len)."""
        assert self._mixing is not None
        starts = self._ring.slots(slices[:, 0])
        steps = self._ring.slots(slices)
        whole = self._is_start[starts]
        whole[whole] = (self._episodes.chain(starts[whole]) == steps[whole]).all(axis=1)
        if not whole.all():
            row = int(np.flatnonzero(~whole)[0])
            raise InvalidPriorityError(
                f"priority_mixing mixes whole slices: row {row} of the update is not a "
                f"slice as sampled (the ids of one slice's {slices.shape[1]} steps, in "
                f"order); update with the batch's ids [B, {slices.shape[1]}] and per-step "
                f"priorities of that shape")
        eta = self._mixing
        return slices[:, 0], eta * per_step.max(axis=1) + (1.0 - eta) * per_step.mean(axis=1)

    def delete(self, positions: np.ndarray) -> Removal:
        """Stop drawing the slices that start at ``positions`` (their rows keep their mass)."""
        slots = self._ring.slots(positions)
        starts = self._is_start[slots]
        gone = slots[starts]
        self._tree.set(gone, np.zeros(gone.size, dtype=np.float32))
        self._is_start[gone] = False
        self._num_starts -= int(gone.size)
        return Removal(positions, starts)

    def restore(self, removal: Removal) -> None:
        assert removal.values is not None
        slots = self._ring.slots(removal.positions[removal.values
                                                   & self._ring.live(removal.positions)])
        back = slots[~self._is_start[slots]]
        self._is_start[back] = True
        self._tree.set(back, self._row_mass[back])
        self._num_starts += int(back.size)

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        total = self._tree.total()
        if self._num_starts == 0:
            raise _no_slices(self._ring, self._episodes)
        if total <= 0.0:
            raise EmptyTableError("every slice start has priority 0, so none can be drawn")
        slots, probabilities, weights = draw_by_priority(
            self._tree, batch_size, generator, self._prio.beta
        )
        chains = self._episodes.chain(slots)
        return SampleIndex(self._ring.ids_of_slots(chains), chains, probabilities, weights)

    def clear(self) -> None:
        self._episodes.clear()
        self._tree.clear()
        self._is_start.fill(False)
        self._num_starts = 0

    def mass(self) -> SamplingMass:
        return SamplingMass(self._tree.total(), self._tree.min_positive(), self._num_starts)

    def stats(self) -> dict[str, Any]:
        return {
            "slices": self._num_starts,
            "open_episodes": self._episodes.open_episodes,
            "max_priority": self._prio.max_priority,
            "priority_mass": self._tree.total(),
            "alpha": self._prio.alpha,
            "beta": self._prio.beta,
        }

    def state_dict(self) -> dict[str, Any]:
        used = self._used
        return {
            "episodes": self._episodes.state_dict(used),
            "priority": self._prio.state_dict(),
            "row_mass": torch.from_numpy(saved_copy(self._row_mass[:used])),
            "is_start": torch.from_numpy(saved_copy(self._is_start[:used])),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._episodes.load_state_dict(state["episodes"])
        self._prio.load_state_dict(state["priority"])
        row_mass, is_start = state["row_mass"].numpy(), state["is_start"].numpy()
        used = row_mass.size
        self._row_mass.fill(0)
        self._row_mass[:used] = row_mass
        self._is_start.fill(False)
        self._is_start[:used] = is_start
        self._num_starts = int(is_start.sum())
        self._tree.load_state_dict({"leaves": torch.from_numpy(np.where(is_start, row_mass, 0.0))})

