"""Samplers: how a table picks the rows of a sample.

All implement :class:`~replay_server.engine.samplers.base.Sampler`; each
takes its ``kind`` (the name a config gives it), its options (a
:class:`SamplerSpec`), traits and memory from its declaration in
:mod:`replay_server.engine.sampler_kinds` (torch-free: configs are checked
against it without loading this package), and states its cost.
:data:`SAMPLERS` is the registry the config's ``sampler`` names and keys are
checked against and the table builds from: a plug-in's sampler is one module,
one :func:`register_sampler` call, and its tests (docs/engine.md, "Adding a
sampler").
"""

from __future__ import annotations

from replay_server.engine.sampler_kinds import SAMPLERS
from replay_server.engine.samplers.base import (
    InsertEvent,
    Removal,
    Sampler,
    SampleIndex,
    SamplerSpec,
    SamplerTraits,
)
from replay_server.engine.samplers.prioritized import PrioritizedSampler
from replay_server.engine.samplers.queue import FifoSampler, LifoSampler, OrderedSampler
from replay_server.engine.samplers.slice import PrioritizedSliceSampler, SliceSampler
from replay_server.engine.samplers.uniform import UniformSampler

__all__ = [
    "SAMPLERS",
    "FifoSampler",
    "InsertEvent",
    "LifoSampler",
    "OrderedSampler",
    "PrioritizedSampler",
    "PrioritizedSliceSampler",
    "Removal",
    "SampleIndex",
    "Sampler",
    "SamplerSpec",
    "SamplerTraits",
    "SliceSampler",
    "UniformSampler",
    "register_sampler",
]


def register_sampler(cls: type[Sampler]) -> type[Sampler]:
    """Make ``cls`` a sampler configs can name (``sampler = cls.kind``), with its options (a
    plug-in's: the class is its own declaration, see :mod:`replay_server.engine.sampler_kinds`).

    Usable as a class decorator; a kind already registered is refused (ValueError).
    ``SAMPLERS.registered(cls.kind, cls)`` registers one for a block (a test's).
    """
    SAMPLERS.register(cls.kind, cls)
    return cls

