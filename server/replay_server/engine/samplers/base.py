"""The one small interface every sampler implements (Reverb's ``ItemSelector`` is the model).

A sampler decides which stored rows a sample draws, and how likely each is.
It works on row *positions* (a row's insertion number inside its table; see
:mod:`replay_server.engine.ids`), never on storage, and hears of every change
exactly once, from its table, under the table's lock:

* ``insert(event)``: rows arrived (and the ring overwrote the oldest ones);
* ``update(positions, priorities)``: new priorities (samplers without
  priorities ignore them; their table refuses such calls before they get here);
* ``delete(positions)``: stop drawing these rows; returns a :class:`Removal`
  that ``restore`` takes back (how a remover retires rows, undoes a failed
  draw, and how a later lease could return rows it took);
* ``sample(batch_size, generator)``: which rows (or slices) to read;
* ``clear()``: every row was removed.

Each sampler class declares what it is, so nothing else matches its name:
``kind`` (the config's name for it), ``options`` (its :class:`SamplerSpec`: the
config keys it takes), ``traits``
(:class:`SamplerTraits`, reported by ``info``), its memory per slot
(:meth:`Sampler.slot_bytes`) and its cost (in its docstring). The table builds
it with :meth:`Sampler.build` from its options.

Samplers work on numpy arrays: single-threaded vectorized loops whose speed
does not depend on how busy the machine's other cores are (torch's intra-op
threads spin badly when they are). The table converts at its boundary.

Thread-safety: none of their own. Every method is called under the table's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from replay_proto.mass import SamplingMass
from replay_server.engine.ids import IdRing
from replay_server.engine.insert_event import InsertEvent
from replay_server.engine.sampler_kinds import SamplerSpec, SamplerTraits
from replay_server.errors import NoPrioritiesError

__all__ = ["InsertEvent", "Removal", "SampleIndex", "Sampler", "SamplerSpec", "SamplerTraits"]


@dataclass(frozen=True, slots=True)
class SampleIndex:
    """Which rows a sample reads, and with what probability they were drawn.

    Attributes:
        ids: int64 positions, ``[B]`` (row samplers) or ``[B, slice_len]`` (slice samplers).
        slots: int64, same shape: where those rows are stored.
        probabilities: float64 ``[B]``: the probability of each drawn row or slice start.
        weights: float32 ``[B]``: importance weights (ones where not prioritized).
    """

    ids: np.ndarray
    slots: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray


@dataclass(frozen=True, slots=True)
class Removal:
    """Rows a sampler stopped drawing, and what it needs to draw them again.

    Plain arrays only (a remover may keep one, e.g. for rows taken under a
    lease, and save it with its state).

    Attributes:
        positions: int64 positions of the rows removed.
        values: the sampler's own per-row record of them (their sampling
            mass, or whether each was a slice start), or ``None``.
    """

    positions: np.ndarray
    values: np.ndarray | None = None


class Sampler(ABC):
    """Chooses rows to sample; maintained incrementally by its table (see the module)."""

    kind: ClassVar[str]
    """The name the config uses for it (``sampler = "..."``)."""

    traits: ClassVar[Any] = SamplerTraits()  # a SamplerTraits (made from replay.proto)

    options: ClassVar[type[SamplerSpec]] = SamplerSpec
    """Its options: the config keys a table with this sampler takes (with their defaults,
    checks and docs)."""

    def __init__(self, ring: IdRing) -> None:
        self._ring = ring

    @classmethod
    def build(cls, ring: IdRing, options: Any, *, deletes: bool) -> Sampler:
        """The sampler over ``ring`` with ``options`` (an instance of :attr:`options`).
        ``deletes``: whether the table will delete single rows (it has a remover)."""
        return cls(ring)

    @classmethod
    @abstractmethod
    def slot_bytes(cls, options: Any, capacity: int, *, deletes: bool) -> int:
        """Bytes of state per slot at ``capacity`` (allocated when the table is made)."""

    @abstractmethod
    def insert(self, event: InsertEvent) -> None:
        """Rows were inserted (and perhaps others evicted)."""

    @abstractmethod
    def update(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        """Set the priorities (float64, validated) of the drawable rows at ``positions``."""

    @abstractmethod
    def delete(self, positions: np.ndarray) -> Removal:
        """Stop drawing the rows at ``positions`` (distinct, live, drawable).

        The rows stay stored until overwritten. Slice samplers stop drawing
        the slices that *start* at those positions.
        """

    @abstractmethod
    def restore(self, removal: Removal) -> None:
        """Draw the rows of ``removal`` again, as before :meth:`delete` (those still live)."""

    @abstractmethod
    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        """Draw ``batch_size`` rows (or slices): with replacement, or, for an
        ordered sampler, the first ``batch_size`` in its order.

        Raises:
            EmptyTableError: nothing can be sampled.
        """

    # Priorities read and re-weighted outside sampling (prioritized samplers override these;
    # their table checks ``traits.priorities`` first): TorchRL's ``rb[i]`` info and its
    # ``rb.sampler.alpha``/``beta`` setters (see :mod:`replay_server.engine.draw_settings`).

    @property
    def alpha(self) -> float | None:
        """The priority exponent in force (``None``: no priorities)."""
        return None

    @property
    def max_priority(self) -> float | None:
        """The priority a new row gets when none is given (``None``: no priorities)."""
        return None

    def priorities(self, positions: np.ndarray) -> np.ndarray:
        """The priorities (float64) of the live rows at ``positions``."""
        raise NoPrioritiesError("this table's sampler does not use priorities")

    def set_exponents(self, alpha: float | None, beta: float | None) -> tuple[float, float]:
        """Change ``alpha`` and/or ``beta`` (``None``: unchanged) from the next draw on;
        returns both."""
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
        """Slots written since the last reset: the prefix of per-slot state worth saving."""
        return self._ring.used


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
