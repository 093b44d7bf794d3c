"""The service's explicit limits: what each call, stream, connection and ring may take.

Every limit comes from ``[server]`` (:class:`~replay_server.service.settings.ServerSettings`)
and is validated there (:func:`check_limits`); :class:`ServiceLimits` holds
them in bytes and seconds, turns the connection limits into gRPC server
options, and describes them for ``info`` and the start-up log.

* ``memory_budget_mb``: bytes all calls together may hold at once; a call
  reserves what it will hold before it holds it (see
  :mod:`replay_server.service.budget`).
* ``max_concurrent_calls``: replay calls served at once; more are refused
  before their request is read.
* ``max_connections``, ``idle_timeout_s``: open connections (more are closed
  at once, by gRPC), and how long one may stay without a call (or without
  finishing its HTTP/2 handshake: at most :data:`HANDSHAKE_TIMEOUT_S`).
* ``max_batch_mb``: the largest batch (or group) one draw may take.
* ``shared_memory_mb``: /dev/shm all same-host rings together may take.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Any

from replay_server.engine.id_space import check_shard
from replay_server.service.budget import BULK_SHARE
from replay_server.errors import ConfigError

MIB = 1 << 20

HANDSHAKE_TIMEOUT_S = 10.0
"""A connection that has not finished its HTTP/2 handshake by then is closed
(sooner with a shorter ``idle_timeout_s``)."""

DEFAULTS = {"memory_budget_mb": 1024, "max_concurrent_calls": 256, "max_connections": 512,
            "idle_timeout_s": 300.0, "max_batch_mb": 256, "shared_memory_mb": 1024}
"""The limits' defaults (``ServerSettings`` takes its defaults from here)."""

RESERVED_FILES = 64
"""Open files a server needs besides its connections (listeners, checkpoint files, rings, logs)."""


def check_limits(settings: Any) -> None:
    """Validate the limit fields of ``settings`` (a ServerSettings).

    Raises:
        ConfigError: naming the field and the value.
    """
    check_shard(settings.shard)
    if not isinstance(settings.start_empty_if_unrestorable, bool):
        raise ConfigError(f"server.start_empty_if_unrestorable must be true or false, got "
                          f"{settings.start_empty_if_unrestorable!r}")
    _int("server.memory_budget_mb", settings.memory_budget_mb, 4, 1 << 22)
    _int("server.max_concurrent_calls", settings.max_concurrent_calls, 1, 1_000_000)
    _int("server.max_connections", settings.max_connections, 1, 1_000_000)
    idle = settings.idle_timeout_s
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not (
        0 < idle < math.inf
    ):
        raise ConfigError(f"server.idle_timeout_s must be a number of seconds > 0, got {idle!r}")
    most = max_batch_mb_for(settings.memory_budget_mb)
    if not isinstance(settings.max_batch_mb, int) or isinstance(settings.max_batch_mb, bool) \
            or not 1 <= settings.max_batch_mb <= most:
        raise ConfigError(
            f"server.max_batch_mb must be an integer in [1, {most}] (3/8 of "
            f"server.memory_budget_mb={settings.memory_budget_mb}: a batch is held twice while "
            f"it is encoded, and large calls share 3/4 of the budget), got "
            f"{settings.max_batch_mb!r}")
    _int("server.shared_memory_mb", settings.shared_memory_mb, 0, 1 << 22)
    _int("server.table_memory_mb", settings.table_memory_mb, 0, 1 << 32)


def max_batch_mb_for(memory_budget_mb: int) -> int:
    """The largest ``max_batch_mb`` a budget allows: twice the batch within the bulk share."""
    return max(1, int(memory_budget_mb * BULK_SHARE) // 2)


def _int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    """The service's limits in bytes and seconds (see the module docstring)."""

    memory_budget_bytes: int
    max_concurrent_calls: int
    max_connections: int
    idle_timeout_s: float
    max_batch_bytes: int
    shared_memory_bytes: int
    max_message_bytes: int

    @classmethod
    def of(cls, settings: Any) -> ServiceLimits:
        """The limits of a validated ServerSettings."""
        return cls(
            memory_budget_bytes=settings.memory_budget_mb * MIB,
            max_concurrent_calls=settings.max_concurrent_calls,
            max_connections=settings.max_connections,
            idle_timeout_s=float(settings.idle_timeout_s),
            max_batch_bytes=settings.max_batch_mb * MIB,
            shared_memory_bytes=settings.shared_memory_mb * MIB,
            max_message_bytes=settings.max_message_bytes,
        )

    @classmethod
    def defaults(cls, max_message_bytes: int) -> ServiceLimits:
        """The default ``[server]`` limits, with the given message size."""
        return cls(memory_budget_bytes=DEFAULTS["memory_budget_mb"] * MIB,
                   max_concurrent_calls=DEFAULTS["max_concurrent_calls"],
                   max_connections=DEFAULTS["max_connections"],
                   idle_timeout_s=DEFAULTS["idle_timeout_s"],
                   max_batch_bytes=DEFAULTS["max_batch_mb"] * MIB,
                   shared_memory_bytes=DEFAULTS["shared_memory_mb"] * MIB,
                   max_message_bytes=max_message_bytes)

    @property
    def handshake_timeout_s(self) -> float:
        return min(self.idle_timeout_s, HANDSHAKE_TIMEOUT_S)

    def grpc_options(self) -> list[tuple[str, int]]:
        """gRPC server options enforcing the connection limits and message sizes."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
            # Per connection: a call over max_concurrent_calls is refused by the service (with
            # its reason); this only keeps one connection from queueing without bound.
            ("grpc.max_concurrent_streams", self.max_concurrent_calls + 16),
            # A stream's flow-control window stays HTTP/2's 64 KiB (plus the message being
            # read): gRPC's bandwidth-delay probe would grow it to megabytes per stream, which
            # a client pushing chunks the server is not reading yet could fill (measured:
            # +640 MiB for 60 such clients against a 256 MiB budget, +240 MiB without it).
            ("grpc.http2.bdp_probe", 0),
        ]

    def ensure_open_files(self) -> None:
        """Raise the process' open-file limit to what ``max_connections`` needs, if allowed.

        Raises:
            ConfigError: the hard limit is too low (``ulimit -n``).
        """
        needed = self.max_connections + RESERVED_FILES
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            if hard != resource.RLIM_INFINITY and hard < needed:
                raise ConfigError(
                    f"server.max_connections={self.max_connections} needs {needed} open files "
                    f"(connections plus {RESERVED_FILES}), but this process may open at most "
                    f"{hard} (ulimit -n); lower max_connections or raise the limit")
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))

    def describe(self) -> dict[str, int | float]:
        """The limits by name, for ``info`` and the log."""
        return {
            "memory_budget_bytes": self.memory_budget_bytes,
            "max_concurrent_calls": self.max_concurrent_calls,
            "max_connections": self.max_connections,
            "idle_timeout_s": self.idle_timeout_s,
            "max_batch_bytes": self.max_batch_bytes,
            "shared_memory_bytes": self.shared_memory_bytes,
            "max_message_bytes": self.max_message_bytes,
        }
