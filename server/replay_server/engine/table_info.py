"""What ``Table.info`` reports (a consistent snapshot of one table), and ``Table.figures``
(a lock-free one)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from replay_proto.capabilities import TableCapabilities
from replay_proto.mass import SamplingMass
from replay_server.engine.rate_limiter import RateLimiterInfo


def field_values(record: Any) -> dict[str, Any]:
    """A flat dataclass's fields and their values (``dataclasses.asdict`` deep-copies each
    value through its recursion: several times the cost for the counters ``info`` sends)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


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
    pinned_bytes: int = 0
    """Bytes of its storage that are page-locked (pinned)."""
    sampler_stats: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    rate_limiter: RateLimiterInfo | None = None
    mass: SamplingMass | None = None
    capabilities: TableCapabilities = field(default_factory=TableCapabilities)
    id_segments: tuple[tuple[int, int], ...] = ()
    """``(incarnation, first_position)`` of each id segment holding stored rows, oldest
    first: the row of sequence ``s`` in a segment lies at storage position
    ``(first_position + s) % capacity``."""


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
