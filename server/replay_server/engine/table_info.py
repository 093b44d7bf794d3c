"""What ``Table.info`` reports (a consistent snapshot of one table), and ``Table.figures``
(a lock-free one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replay_proto.mass import SamplingMass
from replay_server.engine.rate_limiter import RateLimiterInfo


@dataclass(slots=True)
class TableCounters:
    """Monotonic counts since the table was created (kept across reset and restore)."""

    inserted: int = 0
    evicted: int = 0
    sample_calls: int = 0
    sampled: int = 0
    priority_updates: int = 0
    stale_priority_updates: int = 0
    resets: int = 0
    retired: int = 0
    deleted: int = 0
    returned: int = 0  # rows taken under a lease that came back (expired, or given back)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a table does, as its parts declare it (``TableCapabilities`` in
    replay.proto): the sampler's traits (see
    :class:`~replay_server.engine.samplers.base.SamplerTraits`), whether rows
    retire after ``max_times_sampled`` draws, and the readers that shape a
    draw (``n_step``; ``frame_stack_key``, empty when off), and how slices may be
    cut (``partial_slices``: ``strict_length = false``; ``span_left``/``span_right``)."""

    priorities: bool = False
    slices: bool = False
    episodes: bool = False
    consumes: bool = False
    ordered: bool = False
    mergeable: bool = True
    retires: bool = False
    n_step: int = 1
    frame_stack_key: str = ""
    partial_slices: bool = False
    span_left: int = 0
    span_right: int = 0


@dataclass(frozen=True, slots=True)
class TableInfo:
    """A snapshot of one table, for ``info``."""

    name: str
    sampler: str
    capacity: int
    size: int
    schema: dict[str, str] | None
    pinned: bool
    storage_bytes: int
    counters: TableCounters
    sampler_stats: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    rate_limiter: RateLimiterInfo | None = None
    mass: SamplingMass | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)


@dataclass(frozen=True, slots=True)
class TableFigures:
    """A table's size, capacity, bytes stored and counters, read without its lock.

    For readers that must never wait on a busy table (metrics scrapes): each
    figure is exact at some instant, but two figures may be one call apart.
    """

    size: int
    capacity: int
    storage_bytes: int
    counters: TableCounters
