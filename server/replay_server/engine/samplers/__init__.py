"""Samplers: how a table picks the rows of a sample.

All implement :class:`~replay_server.engine.samplers.base.Sampler`; each
declares its ``kind`` (the name a config gives it), traits, memory and
cost. :data:`SAMPLERS` is the registry the config's ``sampler`` names are
checked against and the table builds from: a new sampler is one module
here, one line in :data:`SAMPLERS`, and its tests (docs/engine.md, "Adding
a sampler").
"""

from __future__ import annotations

from replay_server.engine.samplers.base import (
    InsertEvent,
    Removal,
    Sampler,
    SampleIndex,
    SamplerOptions,
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
    "SamplerOptions",
    "SamplerTraits",
    "SliceSampler",
    "UniformSampler",
]

SAMPLERS: dict[str, type[Sampler]] = {
    cls.kind: cls
    for cls in (UniformSampler, PrioritizedSampler, SliceSampler, PrioritizedSliceSampler,
                FifoSampler, LifoSampler)
}
"""Every sampler by the name a config gives it, in the order ``info`` and errors list them."""
