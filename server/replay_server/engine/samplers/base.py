"""The one small interface every sampler implements.

A table is the only orchestrator: under its lock it writes storage, then tells
its sampler about the change exactly once (``insert``, ``update``, ``clear``),
and asks it which rows to read (``sample``). Samplers never call back into the
table or the storage; they see the table's :class:`~replay_server.engine.ids.IdRing`
read-only, to translate between ids and slots.

Samplers work on numpy arrays: single-threaded vectorized loops whose speed
does not depend on how busy the machine's other cores are (torch's intra-op
threads spin badly when they are). The table converts at its boundary.

Thread-safety: none of their own. Every method is called under the table's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from replay_proto.mass import SamplingMass
from replay_server.errors import NoPrioritiesError
from replay_server.engine.ids import IdRing


@dataclass(frozen=True, slots=True)
class SamplerTraits:
    """What a sampler does, declared once on its class, so that nothing else
    (the table, the service, clients) needs to match sampler names.

    Attributes:
        priorities: rows carry priorities (``update`` applies; weights vary).
        slices: a draw is ``slice_len`` consecutive steps of one episode.
        episodes: the sampler reads the episode ids and end flags of inserts.
        consumes: a draw takes its rows (each handed out once; delete applies).
        ordered: rows come out in a fixed order (fifo/lifo), kept per server.
        mergeable: samples of many shards merge exactly by their sampling mass.
    """

    priorities: bool = False
    slices: bool = False
    episodes: bool = False
    consumes: bool = False
    ordered: bool = False
    mergeable: bool = True


@dataclass(frozen=True, slots=True)
class InsertEvent:
    """What one insert changed, as the sampler needs to know it.

    Attributes:
        first_id: id of the first new row; the new ids are consecutive.
        count: number of new rows.
        evicted_first_id: id of the first row overwritten by this insert.
        evicted: number of rows overwritten (their slots now hold new rows).
        priorities: float64 ``[count]`` priorities of the new rows, already
            validated and defaulted (prioritized samplers only, else ``None``).
        episodes: int64 ``[count]`` episode ids (slice samplers only).
        ends: bool ``[count]``: True where a row ends its episode (slice samplers only).
    """

    first_id: int
    count: int
    evicted_first_id: int
    evicted: int
    priorities: np.ndarray | None = None
    episodes: np.ndarray | None = None
    ends: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        return np.arange(self.first_id, self.first_id + self.count, dtype=np.int64)

    @property
    def evicted_ids(self) -> np.ndarray:
        return np.arange(self.evicted_first_id, self.evicted_first_id + self.evicted, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class SampleIndex:
    """Which rows a sample reads, and with what probability they were drawn.

    Attributes:
        ids: int64 ``[B]`` (row samplers) or ``[B, slice_len]`` (slice samplers).
        slots: int64, same shape: where those rows are stored.
        probabilities: float64 ``[B]``: the probability of each drawn row or slice start.
        weights: float32 ``[B]``: importance weights (ones where not prioritized).
    """

    ids: np.ndarray
    slots: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray


class Sampler(ABC):
    """Chooses rows to sample; maintained incrementally by its table."""

    traits: ClassVar[SamplerTraits] = SamplerTraits()

    def __init__(self, ring: IdRing) -> None:
        self._ring = ring

    @abstractmethod
    def insert(self, event: InsertEvent) -> None:
        """Rows were inserted (and perhaps others evicted)."""

    @abstractmethod
    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        """Draw ``batch_size`` rows (or slices), with replacement.

        Raises:
            EmptyTableError: nothing can be sampled.
        """

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Set the priorities (float64, validated) of the live rows at ``slots``."""
        raise NoPrioritiesError("this table's sampler does not use priorities")

    def remove(self, slots: np.ndarray) -> Callable[[], None]:
        """Stop drawing the rows at ``slots`` (distinct, live, not removed yet).

        The rows stay stored until overwritten; this is how ``max_times_sampled``
        retires a row. Returns a function that undoes the removal, for a table
        call that fails after removing. Row samplers only.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot remove single rows")

    @property
    def max_priority(self) -> float | None:
        """The priority a new row gets when none is given (``None``: no priorities)."""
        return None

    @property
    def alpha(self) -> float | None:
        """The priority exponent now (``None``: no priorities); :meth:`set_exponents` changes it."""
        return None

    def priorities(self, slots: np.ndarray) -> np.ndarray:
        """The priorities (float64) of the live rows at ``slots`` (prioritized samplers)."""
        raise NoPrioritiesError("this table's sampler does not use priorities")

    def set_exponents(self, alpha: float | None, beta: float | None) -> tuple[float, float]:
        """Change ``alpha`` and/or ``beta`` from now on; returns both (prioritized samplers)."""
        raise NoPrioritiesError("this table's sampler has no alpha or beta")

    @abstractmethod
    def clear(self) -> None:
        """All rows were removed."""

    @abstractmethod
    def mass(self) -> SamplingMass:
        """The drawable units' total and smallest mass, and their count (O(1); see
        :mod:`replay_proto.mass`): what a sharded client merges shards' samples with."""

    def stats(self) -> dict[str, Any]:
        """Sampler-specific figures for ``info``."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, so it loads without running code."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ring is already restored)."""

    @property
    def _used(self) -> int:
        """Slots ever written: the prefix of per-slot state worth saving."""
        return min(self._ring.next_id, self._ring.capacity)


def importance_weights(probabilities: np.ndarray, min_probability: float, beta: float) -> np.ndarray:
    """``w_i = (N * P(i)) ** -beta / max_j w_j`` as float32.

    ``max_j w_j`` belongs to the least likely row that can be drawn, so
    ``w_i = (min_P / P(i)) ** beta``; N cancels. ``min_probability`` is over
    rows with P > 0 (a row that can never be drawn has no weight).
    """
    return np.power(min_probability / probabilities, beta).astype(np.float32)


def uniform_draws(generator: np.random.Generator, high: int, n: int) -> np.ndarray:
    """``n`` integers in ``[0, high)`` from the table's generator (int64)."""
    return generator.integers(high, size=n, dtype=np.int64)


def sorted_unit_draws(generator: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` iid U[0, 1) draws in ascending order, and a random order to put results in.

    Sorted targets make a prefix-sum search cache-friendly. The draws are the
    order statistics of n iid uniforms (normalized sums of n + 1 exponential
    spacings, O(n), no sort); scattering results through the random
    permutation gives a batch distributed exactly like n iid draws in random
    order.
    """
    sums = np.cumsum(generator.standard_exponential(n + 1))
    draws = sums[:-1] / sums[-1]
    np.minimum(draws, np.nextafter(1.0, 0.0), out=draws)
    order = generator.permutation(n)
    return draws, order
