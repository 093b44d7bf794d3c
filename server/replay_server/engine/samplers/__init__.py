"""Samplers: how a table picks the rows of a sample.

All implement :class:`~replay_server.engine.samplers.base.Sampler`; the table builds
the one its config names with :func:`make_sampler`.
"""

from __future__ import annotations

from replay_server.engine.config import SamplerKind, TableConfig
from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import InsertEvent, Sampler, SampleIndex
from replay_server.engine.samplers.prioritized import PrioritizedSampler
from replay_server.engine.samplers.queue import QueueSampler
from replay_server.engine.samplers.slice import PrioritizedSliceSampler, SliceSampler
from replay_server.engine.samplers.uniform import UniformSampler

__all__ = [
    "InsertEvent",
    "PrioritizedSampler",
    "PrioritizedSliceSampler",
    "QueueSampler",
    "SampleIndex",
    "Sampler",
    "SliceSampler",
    "UniformSampler",
    "make_sampler",
]


def make_sampler(config: TableConfig, ring: IdRing) -> Sampler:
    """The sampler ``config.sampler`` names, over ``ring``."""
    kind = config.sampler
    if kind is SamplerKind.UNIFORM:
        return UniformSampler(ring, retiring=config.max_times_sampled > 0)
    if kind.is_queue:
        return QueueSampler(ring, lifo=kind is SamplerKind.LIFO, max_size=config.max_size)
    if kind is SamplerKind.PRIORITIZED:
        return PrioritizedSampler(ring, config.alpha, config.beta)
    assert config.slice_len is not None
    if kind is SamplerKind.SLICE:
        return SliceSampler(ring, config.slice_len)
    return PrioritizedSliceSampler(ring, config.slice_len, config.alpha, config.beta)
