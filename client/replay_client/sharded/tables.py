"""One logical table over shards: what must agree between them, and its summed ``info``.

:class:`TableShape` is what every shard's copy of a table must share (a
sharded client refuses shards that differ) and what merged sampling needs.
In :func:`summed_tables`, settings (sampler, alpha, beta, schema, the rate limiter's configuration)
are the lowest shard's (a sharded client checks that the sampling settings
agree); sizes, capacities, bytes, counters, the limiters' counts and the
sampling masses are summed; the id segments are every shard's, their storage positions
laid end to end in shard order (:mod:`replay_client.id_positions`); ``max_priority`` is the largest; ``can_insert``
and ``can_sample`` hold if they hold on any shard. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from replay_client.table_info import TableCapabilities, TableInfo
from replay_proto.mass import union_mass


@dataclass(frozen=True, slots=True)
class TableShape:
    """What must agree between the shards of one table, and what sampling needs of it.

    Behaviour is decided on :attr:`capabilities`, never on the sampler's
    name; the name is compared only so that shards configured differently
    are refused.
    """

    sampler: str
    alpha: float
    beta: float
    slice_len: int | None
    episode_key: str
    capabilities: TableCapabilities

    @classmethod
    def of(cls, info: TableInfo) -> TableShape:
        return cls(info.sampler, info.alpha, info.beta, info.slice_len, info.episode_key,
                   info.capabilities)

    @property
    def prioritized(self) -> bool:
        """Weights vary: merged batches get one table's importance weights."""
        return self.capabilities.priorities

    @property
    def by_episode(self) -> bool:
        """Rows are placed by episode (a sample reads slices of one episode)."""
        return self.capabilities.slices or self.capabilities.episodes

    @property
    def mergeable(self) -> bool:
        """Shards' samples merge exactly into one table's (not so for queues)."""
        return self.capabilities.mergeable and not self.capabilities.ordered


def summed_tables(per_shard: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One TableInfo per table: counts and sizes summed, settings as on the lowest shard."""
    tables: dict[str, Any] = {}
    for shard in sorted(per_shard):
        for name, info in per_shard[shard].items():
            total = tables.get(name)
            tables[name] = info if total is None else _add(total, info)
    return tables


def _add(a: Any, b: Any) -> Any:
    stats = dict(a.sampler_stats)
    for key, value in b.sampler_stats.items():
        stats[key] = max(stats.get(key, value), value) if key == "max_priority" else (
            stats.get(key, 0.0) + value)
    limiter = dict(a.rate_limiter)
    for key in ("inserts", "samples", "deletes", "blocked_inserts", "blocked_samples"):
        if key in limiter:
            limiter[key] += b.rate_limiter[key]
    for key in ("can_insert", "can_sample"):
        if key in limiter:
            limiter[key] = limiter[key] or b.rate_limiter[key]
    mass = a.mass
    if a.mass is not None and b.mass is not None:
        mass = union_mass((a.mass, b.mass))
    return replace(
        a, capacity=a.capacity + b.capacity, size=a.size + b.size,
        pinned=a.pinned and b.pinned, storage_bytes=a.storage_bytes + b.storage_bytes,
        pinned_bytes=a.pinned_bytes + b.pinned_bytes,
        schema=a.schema or b.schema,
        counters={k: v + b.counters.get(k, 0) for k, v in a.counters.items()},
        sampler_stats=stats, rate_limiter=limiter, mass=mass,
        id_segments=(*a.id_segments, *(s.moved(a.capacity) for s in b.id_segments)))

