"""The service's explicit limits: what each call, stream, connection and ring may take.

Every limit comes from ``[server]`` (:class:`~replay_server.service.settings.ServerSettings`)
and is validated there (:func:`check_limits`); :class:`ServiceLimits` holds
them in bytes and seconds, turns the connection limits into gRPC server
options, and describes them for ``info`` and the start-up log.

* ``memory_budget_mb``: bytes all calls together may hold at once; a call
  reserves what it will hold before it holds it (see
  :mod:`replay_server.service.budget`).
* ``max_concurrent_calls``: replay calls working at once; more are refused
  before their request is read.
* ``max_waiting_calls``, ``default_wait_s``: calls waiting at once (streams,
  fetches for a newer version, samples and inserts a rate limiter holds or
  that wait for data), a pool of their own, so waiters never take the slots
  of the calls that would release them; and how long a unary call whose
  client set no deadline may wait.
* ``max_streams``: streams (``SampleStream``, ``CallStream``) open at once,
  within the waiting pool; call streams (an actor's small inserts, a
  learner's waiting updates) may take half of them, so that many actors
  never take the learners' sample streams' room. A stream reads messages for its whole life, so
  gRPC may hold a whole message for each; a unary call waits with its request
  read (and reserved from the budget), holding about :data:`WAITER_BYTES`
  outside it. So streams, not waiters, are what the memory bound counts
  (:meth:`ServiceLimits.transport_bound_bytes`).
* ``max_host_share``: the share of each of those pools (working calls,
  waiting calls, streams) the calls of one source address may hold at once
  (at least one slot), so a flood from one place never refuses another
  (:mod:`~replay_server.service.host_shares`); 1.0: no share.
* ``response_timeout_s``: how long a unary call's answer may wait for its
  client to take it (one nobody reads is dropped, its memory freed).
* ``request_timeout_s``: how long the server waits for a message it needs to
  go on: every call's first message (a unary call's request, a stream's
  opening message) and each next message of a chunked request. A call that
  does not send it in time is ended (DEADLINE_EXCEEDED), freeing its slot and
  its memory: silent calls and stalled uploads cannot hold what others wait for.
* ``max_connections``, ``idle_timeout_s``: open connections (more are closed
  at once, by gRPC), and how long one that made calls may stay without one.
* ``handshake_timeout_s``, ``max_idle_connections_per_host``: how long a
  connection may go without its first call, and how many such connections
  one source address may hold (:mod:`~replay_server.service.connections`).
* ``keepalive_s``, ``keepalive_timeout_s``: the server pings every connection
  (HTTP/2 PING) every ``keepalive_s`` and closes one whose ping
  is not answered within ``keepalive_timeout_s``, ending its calls: a peer
  that vanished without a FIN or RST (power loss, partition) gives back what
  its calls held (a stream's leased rows) within their sum, not after TCP's
  retransmissions give up (~15 min). Clients may ping as often as every
  :func:`client_ping_floor_s` (faster: GOAWAY ``too_many_pings``).
* ``memory_wait_s``: how long a unary or chunked call waits for room in the
  memory budget (served in turn per address) before it is refused as
  overloaded.
* ``max_call_resets_per_s``: calls one connection may end before their first
  message (HTTP/2 rapid reset: HEADERS then RST_STREAM) within a second;
  past it the connection is cut (:mod:`~replay_server.service.reset_meter`).
* ``max_control_bytes_per_s``: bytes a connection may send a second that carry
  no call (SETTINGS, WINDOW_UPDATE, PRIORITY, PING frames, beyond an allowance
  per call, message and byte sent); past it the connection is cut
  (:mod:`~replay_server.service.control_meter`).
* ``max_batch_mb``: the largest batch (or group) one draw may take.
* ``shared_memory_mb``: /dev/shm (and CUDA IPC device memory) all same-host rings
  together may take.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Any

from replay_proto.scalars import is_int, is_real
from replay_server.engine import check_shard, format_bytes
from replay_server.errors import ConfigError, TableSpaceError

MIB = 1 << 20

BULK_SHARE = 0.75
"""Share of the memory budget larger reservations may take together
(:class:`~replay_server.service.budget.MemoryBudget`)."""

DEFAULTS: dict[str, Any] = {  # ints where the setting is a count or MiB, floats for seconds
    "memory_budget_mb": 1024, "max_concurrent_calls": 256, "max_connections": 512,
    "idle_timeout_s": 300.0, "max_batch_mb": 256, "shared_memory_mb": 1024,
    "handshake_timeout_s": 5.0, "max_idle_connections_per_host": 16,
    "max_waiting_calls": 1024, "max_streams": 128, "default_wait_s": 300.0,
    "response_timeout_s": 60.0, "keepalive_s": 30.0, "keepalive_timeout_s": 10.0,
    "request_timeout_s": 5.0, "max_call_resets_per_s": 20.0, "memory_wait_s": 1.0,
    "max_control_bytes_per_s": 65536, "max_host_share": 0.75}
"""The limits' defaults (``ServerSettings`` takes its defaults from here)."""

WINDOW_BYTES = 64 << 10
"""A stream's HTTP/2 flow-control window: what a client may send it that nobody reads yet
(the server turns off gRPC's bandwidth-delay probe, which grew it to megabytes)."""

WAITER_BYTES = 96 << 10
"""What a waiting unary call holds outside the budget at most: its stream's window, which a
lying client may fill, plus the call's own state (measured: 25 KiB per waiting fetch, 500
of them)."""

RESERVED_FILES = 64
"""Open files a server needs besides its connections (listeners, checkpoint files, rings, logs)."""

RUNTIME_ADDRESS_SPACE = 3 << 29
"""Address space the server's runtime takes besides tables and calls (interpreter, torch,
gRPC, thread stacks): an idle server maps about 1.2 GiB; 1.5 GiB leaves room for load."""

HEALTH_MAX_CONNECTIONS = 16
"""Connections the plaintext health listener (``health_address``) takes at once."""

METRICS_MAX_CONNECTIONS = 16
"""Connections the ``/metrics`` listener takes at once (scrapes, served by a few threads)."""

SIDE_LISTENER_IDLE_S = 10.0
"""A health or metrics connection is closed after this long without a request."""

CLIENT_PING_FLOOR_S = 10.0
"""Clients may ping at most this often (or every ``keepalive_s``, if that is shorter); the
replay client pings every 60 s (``replay_client.connection.KEEPALIVE_S``)."""


def client_ping_floor_s(keepalive_s: float) -> float:
    """The shortest interval the server accepts between a client's pings on a connection that
    sends no data: :data:`CLIENT_PING_FLOOR_S`, or ``keepalive_s`` if shorter (a client may
    ping as often as the server does). gRPC counts a faster ping as a strike and closes the
    connection (GOAWAY ``too_many_pings``) after two."""
    return min(CLIENT_PING_FLOOR_S, keepalive_s)


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
    if not is_real(idle) or not 0 < idle < math.inf:
        raise ConfigError(f"server.idle_timeout_s must be a number of seconds > 0, got {idle!r}")
    handshake = settings.handshake_timeout_s
    if not is_real(handshake) or not 0.1 <= handshake <= 60:
        raise ConfigError(f"server.handshake_timeout_s must be a number of seconds in [0.1, "
                          f"60], got {handshake!r}")
    _int("server.max_idle_connections_per_host", settings.max_idle_connections_per_host, 1,
         settings.max_connections)
    _int("server.max_waiting_calls", settings.max_waiting_calls, 1, 1_000_000)
    _int("server.max_streams", settings.max_streams, 1, 1_000_000)
    share = settings.max_host_share
    if not is_real(share) or not 0 < share <= 1:
        raise ConfigError(f"server.max_host_share must be a number in (0, 1] (the share of "
                          f"each call pool one source address may hold; 1.0: no share), got "
                          f"{share!r}")
    _seconds("server.keepalive_s", settings.keepalive_s, 1.0, 86_400.0)
    _seconds("server.keepalive_timeout_s", settings.keepalive_timeout_s, 1.0, 3_600.0)
    wait = settings.default_wait_s
    if not is_real(wait) or not 0 < wait < math.inf:
        raise ConfigError(f"server.default_wait_s must be a number of seconds > 0, got {wait!r}")
    _seconds("server.request_timeout_s", settings.request_timeout_s, 0.1, 3_600.0)
    _seconds("server.memory_wait_s", settings.memory_wait_s, 0.01, 3_600.0)
    rate = settings.max_call_resets_per_s
    if not is_real(rate) or not 1 <= rate <= 1e6:
        raise ConfigError(f"server.max_call_resets_per_s must be a number of calls per second "
                          f"in [1, 1e6], got {rate!r}")
    control = settings.max_control_bytes_per_s
    if not is_int(control) or not 1024 <= control <= 1 << 40:
        raise ConfigError(f"server.max_control_bytes_per_s must be an integer number of bytes "
                          f"per second in [1024, 2**40], got {control!r}")
    answer = settings.response_timeout_s
    if not is_real(answer) or not 0 < answer < math.inf:
        raise ConfigError(
            f"server.response_timeout_s must be a number of seconds > 0, got {answer!r}")
    most = max_batch_mb_for(settings.memory_budget_mb)
    if not is_int(settings.max_batch_mb) or not 1 <= settings.max_batch_mb <= most:
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


def _seconds(name: str, value: Any, low: float, high: float) -> None:
    if not is_real(value) or not low <= value <= high:
        raise ConfigError(f"{name} must be a number of seconds in [{low:g}, {high:g}], got "
                          f"{value!r}")


def _int(name: str, value: Any, low: int, high: int) -> None:
    if not is_int(value) or not low <= value <= high:
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
    handshake_timeout_s: float = DEFAULTS["handshake_timeout_s"]
    max_idle_connections_per_host: int = DEFAULTS["max_idle_connections_per_host"]
    max_waiting_calls: int = DEFAULTS["max_waiting_calls"]
    max_streams: int = DEFAULTS["max_streams"]
    default_wait_s: float = DEFAULTS["default_wait_s"]
    response_timeout_s: float = DEFAULTS["response_timeout_s"]
    keepalive_s: float = DEFAULTS["keepalive_s"]
    keepalive_timeout_s: float = DEFAULTS["keepalive_timeout_s"]
    request_timeout_s: float = DEFAULTS["request_timeout_s"]
    max_call_resets_per_s: float = DEFAULTS["max_call_resets_per_s"]
    memory_wait_s: float = DEFAULTS["memory_wait_s"]
    max_control_bytes_per_s: int = DEFAULTS["max_control_bytes_per_s"]
    max_host_share: float = DEFAULTS["max_host_share"]

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
            handshake_timeout_s=min(float(settings.handshake_timeout_s),
                                    float(settings.idle_timeout_s)),
            max_idle_connections_per_host=settings.max_idle_connections_per_host,
            max_waiting_calls=settings.max_waiting_calls,
            # streams wait in the waiting pool too: never more than it holds
            max_streams=min(settings.max_streams, settings.max_waiting_calls),
            default_wait_s=float(settings.default_wait_s),
            response_timeout_s=float(settings.response_timeout_s),
            keepalive_s=float(settings.keepalive_s),
            keepalive_timeout_s=float(settings.keepalive_timeout_s),
            request_timeout_s=float(settings.request_timeout_s),
            max_call_resets_per_s=float(settings.max_call_resets_per_s),
            memory_wait_s=float(settings.memory_wait_s),
            max_control_bytes_per_s=int(settings.max_control_bytes_per_s),
            max_host_share=float(settings.max_host_share),
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
    def max_idle_connections(self) -> int:
        """Connections without a call kept from all addresses together: a quarter of the port."""
        return max(1, self.max_connections // 4)

    @property
    def transport_bound_bytes(self) -> int:
        """What calls may make the server hold at most, besides its tables, whatever clients
        send or declare (docs/service.md, "Limits"):

            memory_budget + (max_concurrent_calls + max_streams) x (2 x max_message + window)
                          + max_waiting_calls x WAITER_BYTES

        the budget for everything admitted; per working call and per stream, one message
        gRPC reads before the handler sees its size (held twice for a moment: gRPC's buffer
        and the copy it hands over) plus its window; per waiting call, its window and
        state (its request is read and in the budget)."""
        per_reader = 2 * self.max_message_bytes + WINDOW_BYTES
        return (self.memory_budget_bytes
                + (self.max_concurrent_calls + self.max_streams) * per_reader
                + self.max_waiting_calls * WAITER_BYTES)

    def grpc_options(self) -> list[tuple[str, int]]:
        """gRPC server options enforcing the connection limits and message sizes."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
            # Per connection: a call over the pools is refused by the service (with its
            # reason); this only keeps one connection from queueing without bound.
            ("grpc.max_concurrent_streams",
             self.max_concurrent_calls + self.max_waiting_calls + 16),
            # A stream's flow-control window stays HTTP/2's 64 KiB (plus the message being
            # read): gRPC's bandwidth-delay probe would grow it to megabytes per stream, which
            # a client pushing chunks the server is not reading yet could fill (measured:
            # +640 MiB for 60 such clients against a 256 MiB budget, +240 MiB without it).
            ("grpc.http2.bdp_probe", 0),
            *self.keepalive_options(),
        ]

    def keepalive_options(self) -> list[tuple[str, int]]:
        """gRPC server options of the keepalive (see the module docstring)."""
        return [
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            # gRPC (1.85) waits for a ping's answer this long whatever keepalive_timeout_ms
            # says (its default: 60 s).
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            # Ping a connection whose calls send nothing (a stream waiting for credits from a
            # learner that vanished): gRPC's default stops after two pings without data.
            ("grpc.http2.max_pings_without_data", 0),
            # Ping connections without calls too, and accept clients' pings on them.
            ("grpc.keepalive_permit_without_calls", 1),
            # The shortest interval accepted between a client's pings (gRPC's default: 5 min,
            # which a client pinging every minute would break with too_many_pings).
            ("grpc.http2.min_ping_interval_without_data_ms",
             int(client_ping_floor_s(self.keepalive_s) * 1000)),
        ]

    @property
    def open_files(self) -> int:
        """Descriptors the server may need at most: every connection of every listener, plus
        :data:`RESERVED_FILES`."""
        return (self.max_connections + HEALTH_MAX_CONNECTIONS + METRICS_MAX_CONNECTIONS
                + RESERVED_FILES)

    def side_listener_options(self) -> list[tuple[str, int]]:
        """gRPC options of the plaintext health listener: few connections, none kept idle."""
        idle_ms = int(SIDE_LISTENER_IDLE_S * 1000)
        return [("grpc.max_allowed_incoming_connections", HEALTH_MAX_CONNECTIONS),
                ("grpc.max_connection_idle_ms", idle_ms),
                ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
                ("grpc.max_concurrent_streams", 4),
                ("grpc.max_receive_message_length", 1 << 16),
                ("grpc.so_reuseport", 0)]

    def ensure_open_files(self) -> None:
        """Raise the process' open-file limit to what ``max_connections`` needs, if allowed.

        Raises:
            ConfigError: the hard limit is too low (``ulimit -n``).
        """
        needed = self.open_files
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            if hard != resource.RLIM_INFINITY and hard < needed:
                raise ConfigError(
                    f"server.max_connections={self.max_connections} needs {needed} open files "
                    f"(connections plus {needed - self.max_connections} for listeners, files "
                    f"and the health and metrics connections), but this process may open at most "
                    f"{hard} (ulimit -n); lower max_connections or raise the limit")
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))

    def table_memory_within_address_space(self, table_limit: int | None) -> int | None:
        """The tables' memory limit once this process' address-space limit (``ulimit -v``)
        is counted: what remains after the runtime and the calls' budget, if that is lower
        than ``table_limit`` (``None``: no limit set, the machine's memory).

        A server under a low ``RLIMIT_AS`` used to die of ``std::bad_alloc`` deep in a
        library; now its tables are promised no more than the limit leaves, and a limit
        too low to serve at all stops the start, saying so.

        Raises:
            TableSpaceError: the limit leaves nothing for tables (names the limit, the
                runtime's share and ``memory_budget_mb``).
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return table_limit
        left = soft - RUNTIME_ADDRESS_SPACE - self.memory_budget_bytes
        if left <= 0:
            raise TableSpaceError(
                f"this process may map at most {format_bytes(soft)} (ulimit -v, RLIMIT_AS), "
                f"which leaves nothing for tables after the runtime (about "
                f"{format_bytes(RUNTIME_ADDRESS_SPACE)}) and server.memory_budget_mb = "
                f"{self.memory_budget_bytes >> 20}; raise the limit or lower "
                f"server.memory_budget_mb")
        return left if table_limit is None else min(left, table_limit)

    def summary(self) -> str:
        """The limits in one sentence, for the server's start-up log."""
        return (f"calls may hold {format_bytes(self.memory_budget_bytes)} at once "
                f"({format_bytes(self.transport_bound_bytes)} at most with what gRPC holds "
                f"before admission), {self.max_concurrent_calls} calls, "
                f"{self.max_waiting_calls} waiting ({self.max_streams} streams; "
                f"{self.max_host_share:g} of each per address), "
                f"{self.request_timeout_s:g} s to send a request, {self.max_connections} "
                f"connections (idle {self.idle_timeout_s:.0f} s, {self.handshake_timeout_s:g} s "
                f"to a first call, {self.max_idle_connections_per_host} without one per host, "
                f"pinged every {self.keepalive_s:g} s, closed {self.keepalive_timeout_s:g} s "
                f"after an unanswered ping), batches up to {format_bytes(self.max_batch_bytes)}, "
                f"shared-memory rings {format_bytes(self.shared_memory_bytes)}")

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
            "handshake_timeout_s": self.handshake_timeout_s,
            "max_idle_connections_per_host": self.max_idle_connections_per_host,
            "max_waiting_calls": self.max_waiting_calls,
            "max_streams": self.max_streams,
            "default_wait_s": self.default_wait_s,
            "response_timeout_s": self.response_timeout_s,
            "request_timeout_s": self.request_timeout_s,
            "max_call_resets_per_s": self.max_call_resets_per_s,
            "memory_wait_s": self.memory_wait_s,
            "max_control_bytes_per_s": self.max_control_bytes_per_s,
            "max_host_share": self.max_host_share,
        }
