"""The samplers a config can name: each one's options, traits and memory, declared without torch.

A sampler is declared here (:class:`DeclaredSampler`: its ``kind``, its
options' spec, its :data:`SamplerTraits` and its memory per slot) and
implemented in its module under ``engine/samplers/``, whose class takes
those facts from its declaration, so each is stated once. :data:`SAMPLERS`
is the registry configs are checked against and tables build from: a
declaration imports its implementation the first time a table is built
with it, so reading and checking a config (``replay-server check-config``)
loads no torch. A sampler a plug-in registers as a class
(:func:`replay_server.engine.samplers.register_sampler`) serves as its own
declaration: it has the same attributes.

Thread-safety: specs and declarations are immutable; registering is meant
for import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from replay_proto.capabilities import TableCapabilities
from replay_proto.scalars import is_int, is_real
from replay_server.engine.options import LayerSpec, Registry, option
from replay_server.engine.slot_memory import (
    SUMTREE_SLOT_BYTES,
    heads_bytes,
    index_bytes,
    slotset_bytes,
)
from replay_server.errors import ConfigError

SamplerTraits = TableCapabilities
"""What a sampler does, declared once (``traits``), so that nothing else (the table, the
service, clients) needs to match sampler names: its share of its table's capabilities
(:mod:`replay_proto.capabilities`), ``priorities``, ``slices``, ``episodes``, ``consumes``
(a draw takes its rows: the table gives it a remover of limit 1, see
:mod:`replay_server.engine.remover`), ``ordered`` and ``mergeable``; the table fills in
the rest from its readers and options."""

DEFAULT_LEASE_TIMEOUT_S = 60.0
"""How long a queue's rows taken under a lease wait for their acknowledgement by default."""

MAX_LEASE_TIMEOUT_S = 86_400.0
"""The longest ``lease_timeout_s`` (a day)."""


@dataclass(frozen=True, kw_only=True)
class SamplerSpec(LayerSpec):
    """A sampler's options (none here: ``uniform``'s, ``fifo``'s). A sampler with options
    subclasses it and names it as its :attr:`DeclaredSampler.options`; the table's config
    then takes exactly those keys with that sampler (see :mod:`replay_server.engine.options`)."""


@dataclass(frozen=True, kw_only=True)
class PriorityOptions(SamplerSpec):
    """The options of the prioritized samplers (proportional PER)."""

    alpha: float = option(0.6, "priority exponent: P(i) = p_i^alpha / sum_k p_k^alpha",
                          inert=True)
    beta: float = option(0.4, "importance-weight exponent: w_i = (N * P(i))^-beta / max_j w_j",
                         inert=True)

    def check(self, where: str, capacity: int) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
            self._set(name, float(value))


@dataclass(frozen=True, kw_only=True)
class SliceShape(SamplerSpec):
    """The options of the slice samplers: how long a slice is, and how it may be cut
    (partial slices: :mod:`replay_server.engine.samplers.slice`)."""

    slice_len: int | None = option(None, "steps per sampled slice", required=True)
    strict_length: bool = option(
        True, "false: a slice may also start at an episode's first stored step however "
              "short the episode, cut at its last stored step")
    span_right: int = option(
        0, "windows may end up to this many steps past an episode's last stored step "
           "(a slice keeps at least slice_len - span_right steps); in [0, slice_len - 1]")

    def check(self, where: str, capacity: int) -> None:
        if not is_int(self.slice_len) or not 1 <= self.slice_len <= capacity:
            raise ConfigError(f"{where}: slice_len must be an integer in [1, capacity="
                              f"{capacity}], got {self.slice_len!r}")
        if not isinstance(self.strict_length, bool):
            raise ConfigError(f"{where}: strict_length must be true or false, got "
                              f"{self.strict_length!r}")
        for name in ("span_left", "span_right"):
            value = getattr(self, name, 0)
            if not is_int(value) or value < 0:
                raise ConfigError(f"{where}: {name} must be an integer >= 0, got {value!r}")
            if value >= self.slice_len:
                raise ConfigError(
                    f"{where}: {name} must be in [0, slice_len - 1 = {self.slice_len - 1}] (a "
                    f"slice keeps at least one step), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SliceOptions(SliceShape):
    """The options of sampler ``slice``."""

    span_left: int = option(
        0, "windows may also begin up to this many steps before an episode's first stored "
           "step, the steps before it cut; in [0, slice_len - 1]")


@dataclass(frozen=True, kw_only=True)
class PrioritizedSliceOptions(SliceShape, PriorityOptions):
    """The options of sampler ``prioritized_slice``: a slice's shape and priorities (no
    ``span_left``: a slice is drawn by the priority of its first stored step)."""

    priority_mixing: float | None = option(
        None, "eta: a priority update is of whole slices, each slice's start getting "
              "eta * max + (1 - eta) * mean of its steps' priorities (R2D2); unset: per row")

    def check(self, where: str, capacity: int) -> None:
        PriorityOptions.check(self, where, capacity)
        SliceShape.check(self, where, capacity)
        eta = self.priority_mixing
        if eta is None:
            return
        if not is_real(eta) or not 0.0 <= eta <= 1.0:
            raise ConfigError(f"{where}: priority_mixing must be a number in [0, 1] or "
                              f"omitted, got {eta!r}")
        self._set("priority_mixing", float(eta))


@dataclass(frozen=True, kw_only=True)
class QueueOptions(SamplerSpec):
    """The options of the samplers that take their rows (``fifo``/``lifo``)."""

    lease_timeout_s: float | None = option(
        None, "seconds a sample's rows stay its taker's (a lease) before they return to the "
              "queue unless acknowledged; unset: 60")

    def check(self, where: str, capacity: int) -> None:
        timeout = self.lease_timeout_s
        if timeout is None:
            return
        if not is_real(timeout) or not 0 < timeout <= MAX_LEASE_TIMEOUT_S:
            raise ConfigError(f"{where}: lease_timeout_s must be a number of seconds in "
                              f"(0, {MAX_LEASE_TIMEOUT_S:g}] or omitted, got {timeout!r}")
        self._set("lease_timeout_s", float(timeout))

    @property
    def effective_lease_timeout_s(self) -> float:
        """``lease_timeout_s`` with its default resolved."""
        return DEFAULT_LEASE_TIMEOUT_S if self.lease_timeout_s is None else self.lease_timeout_s


@dataclass(frozen=True)
class DeclaredSampler:
    """A sampler as configs name it, its implementation imported when first built.

    Attributes:
        kind: the name (``sampler = "<kind>"``).
        options: its options' spec.
        traits: what it does (:data:`SamplerTraits`).
        per_slot: its memory per slot: ``(options, capacity, deletes) -> bytes`` (``deletes``:
            the table deletes single rows, having a remover).
        home: ``"module:Class"``, the implementation (a ``Sampler`` subclass).
    """

    kind: str
    options: type[SamplerSpec]
    traits: Any
    per_slot: Callable[[Any, int, bool], int]
    home: str

    def slot_bytes(self, options: Any, capacity: int, *, deletes: bool) -> int:
        """Bytes of state per slot at ``capacity`` (allocated when the table is made)."""
        return self.per_slot(options, capacity, deletes)

    @property
    def implementation(self) -> Any:
        """The sampler class (its module imported on first use: this loads torch)."""
        module, _, name = self.home.partition(":")
        return getattr(import_module(module), name)

    def build(self, ring: Any, options: Any, *, deletes: bool) -> Any:
        """The implementation's sampler over ``ring`` (see ``Sampler.build``)."""
        return self.implementation.build(ring, options, deletes=deletes)


SAMPLERS: Registry[Any] = Registry("sampler")
"""Every sampler by the name a config gives it, in the order ``info`` and errors list them:
a :class:`DeclaredSampler`, or a plug-in's ``Sampler`` class (the same attributes)."""

_HOME = "replay_server.engine.samplers"
_QUEUE = SamplerTraits(consumes=True, ordered=True, mergeable=False)

UNIFORM = DeclaredSampler(
    "uniform", SamplerSpec, SamplerTraits(),
    lambda options, capacity, deletes: slotset_bytes(capacity) if deletes else 0,
    f"{_HOME}.uniform:UniformSampler")
PRIORITIZED = DeclaredSampler(
    "prioritized", PriorityOptions, SamplerTraits(priorities=True),
    lambda options, capacity, deletes: SUMTREE_SLOT_BYTES,
    f"{_HOME}.prioritized:PrioritizedSampler")
SLICE = DeclaredSampler(
    "slice", SliceOptions, SamplerTraits(slices=True, episodes=True),
    lambda options, capacity, deletes: (index_bytes(capacity) + slotset_bytes(capacity)
                                        + (heads_bytes(capacity) if options.span_left else 0)),
    f"{_HOME}.slice:SliceSampler")
PRIORITIZED_SLICE = DeclaredSampler(
    # links, the tree, each row's mass (float32) and whether it starts a slice (bool)
    "prioritized_slice", PrioritizedSliceOptions,
    SamplerTraits(priorities=True, slices=True, episodes=True),
    lambda options, capacity, deletes: index_bytes(capacity) + SUMTREE_SLOT_BYTES + 4 + 1,
    f"{_HOME}.slice:PrioritizedSliceSampler")
FIFO = DeclaredSampler("fifo", QueueOptions, _QUEUE, lambda options, capacity, deletes: 0,
                       f"{_HOME}.queue:FifoSampler")
LIFO = DeclaredSampler("lifo", QueueOptions, _QUEUE, lambda options, capacity, deletes: 0,
                       f"{_HOME}.queue:LifoSampler")

for _declared in (UNIFORM, PRIORITIZED, SLICE, PRIORITIZED_SLICE, FIFO, LIFO):
    SAMPLERS.register(_declared.kind, _declared)
