"""What ``info`` returns, decoded once from ``InfoResponse``: each table's
settings, counters and capabilities (:class:`~replay_proto.capabilities.TableCapabilities`:
decide on these, never on the sampler's name), and the server's shard, incarnation and limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replay_client.id_positions import IdSegment
from replay_proto.capabilities import TableCapabilities
from replay_proto.mass import SamplingMass
from replay_proto.v1 import replay_pb2 as pb

_COUNTER_FIELDS = tuple(pb.TableCounters.DESCRIPTOR.fields_by_name)
_LIMITER_FIELDS = tuple(pb.RateLimiterInfo.DESCRIPTOR.fields_by_name)
_SERVER_LIMIT_FIELDS = tuple(pb.ServerLimits.DESCRIPTOR.fields_by_name)


@dataclass(frozen=True, slots=True)
class TableInfo:
    """One table as the server reports it.

    ``rate_limiter`` holds the fields of ``RateLimiterInfo`` in
    ``replay.proto`` (``enabled``, ``min_size_to_sample``, ``samples_per_insert``,
    ``error_buffer``, ``inserts``, ``samples``, ``deletes``, ``can_insert``,
    ``can_sample``, ``blocked_inserts``, ``blocked_samples``, ...).
    """

    name: str
    sampler: str
    capacity: int
    size: int
    schema: dict[str, str]
    pinned: bool
    storage_bytes: int
    counters: dict[str, int]
    sampler_stats: dict[str, float]
    alpha: float
    beta: float
    slice_len: int | None
    rate_limiter: dict[str, Any]
    max_times_sampled: int
    mass: SamplingMass | None = None
    episode_key: str = "episode"
    pinned_bytes: int = 0
    """Bytes of its storage that are page-locked (pinned: a server on a CUDA host with
    ``pin_memory``); over shards, their sum."""
    capabilities: TableCapabilities = TableCapabilities()
    id_segments: tuple[IdSegment, ...] = ()
    """Where the stored rows of each id segment lie (:mod:`replay_client.id_positions`)."""

    @property
    def writer_episode_key(self) -> str | None:
        """The column a :class:`~replay_client.writer.Writer` puts its episode ids in: the
        table's ``episode_key`` where the table keeps episodes, or where its schema has
        that column, or reads n-step returns (which follow episodes); ``None`` (no column
        added) elsewhere, since a table without episodes would refuse the extra column."""
        if (self.capabilities.episodes or self.capabilities.n_step > 1
                or self.episode_key in self.schema):
            return self.episode_key
        return None


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The server as a whole: its shard and id incarnation, its limits, and its tables.

    ``shard`` is bits 56..62 of every id the server issues (a sharded client
    routes an id to shard ``id >> 56``); ``incarnation`` is bits 40..55 of
    the ids it issues now. ``limits`` holds the fields of ``ServerLimits`` in
    ``replay.proto`` (``memory_budget_bytes``, ``memory_in_use_bytes``,
    ``max_concurrent_calls``, ``calls_in_flight``, ``max_connections``, ...).
    """

    shard: int
    incarnation: int
    limits: dict[str, int | float]
    tables: dict[str, TableInfo]


def tables_of(response: pb.InfoResponse) -> dict[str, TableInfo]:
    """Every table of an ``InfoResponse``, by name."""
    shard = response.shard
    return {
        t.name: TableInfo(
            name=t.name, sampler=t.sampler, capacity=t.capacity, size=t.size,
            schema=dict(t.schema), pinned=t.pinned, storage_bytes=t.storage_bytes,
            pinned_bytes=t.pinned_bytes,
            counters={f: getattr(t.counters, f) for f in _COUNTER_FIELDS},
            sampler_stats=dict(t.sampler_stats), alpha=t.alpha, beta=t.beta,
            slice_len=t.slice_len or None,
            rate_limiter={f: getattr(t.rate_limiter, f) for f in _LIMITER_FIELDS},
            max_times_sampled=t.max_times_sampled,
            mass=SamplingMass.from_proto(t.mass) if t.HasField("mass") else None,
            episode_key=t.episode_key or "episode",
            capabilities=TableCapabilities.from_proto(t.capabilities),
            id_segments=tuple(IdSegment(shard, s.incarnation, s.first_position, t.capacity)
                              for s in t.id_segments),
        )
        for t in response.tables
    }


def server_info_of(response: pb.InfoResponse) -> ServerInfo:
    """The server's shard, id incarnation, limits and tables from an ``InfoResponse``."""
    limits = {f: getattr(response.limits, f) for f in _SERVER_LIMIT_FIELDS}
    return ServerInfo(shard=response.shard, incarnation=response.incarnation,
                      limits=limits, tables=tables_of(response))
