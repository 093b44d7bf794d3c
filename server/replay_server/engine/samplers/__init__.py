"""Samplers: how a table picks the rows of a sample.

All implement :class:`~replay_server.engine.samplers.base.Sampler`; each
declares its ``kind`` (the name a config gives it), its options (a
:class:`SamplerSpec`), traits, memory and cost. :data:`SAMPLERS` is the
registry the config's ``sampler`` names and keys are checked against and the
table builds from: a new sampler is one module, one :func:`register_sampler`
call, and its tests (docs/engine.md, "Adding a sampler").
"""

from __future__ import annotations

from replay_server.engine.options import Registry

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

SAMPLERS: Registry[type[Sampler]] = Registry("sampler")
"""Every sampler by the name a config gives it, in the order ``info`` and errors list them."""


def register_sampler(cls: type[Sampler]) -> type[Sampler]:
    """Make ``cls`` a sampler configs can name (``sampler = cls.kind``), with its options.

    Usable as a class decorator; a kind already registered is refused (ValueError).
    ``SAMPLERS.registered(cls.kind, cls)`` registers one for a block (a test's).
    """
    SAMPLERS.register(cls.kind, cls)
    return cls


for _sampler in (UniformSampler, PrioritizedSampler, SliceSampler, PrioritizedSliceSampler,
                 FifoSampler, LifoSampler):
    register_sampler(_sampler)
