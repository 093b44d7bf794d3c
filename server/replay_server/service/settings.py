"""How the server listens and runs: a frozen dataclass, validated at construction.

The ``[server]`` section of a config file (read by
:mod:`replay_server.app.config_file`) becomes a :class:`ServerSettings`;
so can a program that builds one directly (the embedded server). Every bad
value raises :class:`~replay_server.errors.ConfigError` naming the field and
the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from replay_proto.addresses import DEFAULT_ADDRESS, is_loopback
from replay_proto.scalars import is_int, is_real
from replay_server.engine import TableConfig, default_table_configs
from replay_server.errors import ConfigError
from replay_server.service.limits import DEFAULTS as LIMIT_DEFAULTS
from replay_server.service.limits import check_limits
from replay_server.service.shard_index import resolve_shard

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


def cuda_present() -> bool:
    """Whether this machine has a CUDA device (:func:`replay_feed.accelerator.cuda_present`),
    imported when asked: only ``pin_memory = "true"`` at load and ``"auto"`` at start ask,
    so reading any other config loads no torch."""
    from replay_feed.accelerator import cuda_present as present

    return present()


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """How the server listens and runs.

    Attributes:
        address: ``host:port`` to listen on (port 0: any free port).
        pin_memory: ``"auto"`` pins table storage when a CUDA device is
            present; ``"true"`` without one is an error; ``"false"`` never pins.
        auth_token_env: environment variable holding the token clients must
            send (``authorization: Bearer <token>``); ``None``: no auth.
        max_message_mb: largest gRPC message either way, in MiB.
        workers: threads that run engine work off the event loop.
        log_format: ``"text"`` or ``"json"`` (one JSON object per line).
        shared_memory: offer learners on this host a shared-memory ring for
            ``SampleStream`` batches, and clients on this host a region for their large
            inserts (they fall back to gRPC when they cannot map it).
        checkpoint_dir: where checkpoints are written and restored from
            (relative: to the working directory; created if missing);
            ``None``: no persistence.
        checkpoint_interval_s: seconds between timed checkpoints (counted
            from the end of the previous one); 0: only on request and at shutdown.
        keep_latest: complete checkpoints kept (older ones are removed).
        tables: the tables to serve.
        variables_max_mb: budget, in MiB, for all named variables together
            (``client.publish``); a publish past it is refused.
        shard: this server's shard index (0..127), carried in every row id it
            issues (see :mod:`replay_server.engine.id_space`); ``"auto"``: a
            StatefulSet pod's ordinal (:mod:`replay_server.service.shard_index`),
            resolved here.
        start_empty_if_unrestorable: when checkpoints exist but none can be
            restored, start with empty tables (and keep the checkpoints) instead
            of refusing to start.
        memory_budget_mb: bytes all calls together may hold at once (requests
            read, batches drawn, responses not yet taken by slow readers), in
            MiB; a call that does not fit is refused (RESOURCE_EXHAUSTED).
        max_concurrent_calls: replay calls working at once (health checks and
            waiting calls aside).
        max_waiting_calls: calls waiting at once (streams; fetches, samples and
            inserts waiting for a newer version, for data or for their rate
            limiter), a pool of their own; more are refused (RESOURCE_EXHAUSTED).
        max_streams: streams (``SampleStream``, ``CallStream``) open at once, within
            the waiting pool (at most ``max_waiting_calls``; call streams at most half of
            it); more are refused (RESOURCE_EXHAUSTED; a refused call stream's client
            makes plain calls). Each may have gRPC hold a whole message, so this,
            not ``max_waiting_calls``, is what the memory bound counts.
        max_host_share: the share of each call pool (working calls, waiting calls,
            streams) the calls of one source address may hold at once, in (0, 1]; at
            least one slot each. A call past it is refused (RESOURCE_EXHAUSTED), so a
            flood from one place never refuses another; 1.0: no share (clients that
            all come through one address: a NAT, a node proxy).
        default_wait_s: how long a unary call whose client set no deadline may
            wait (a fetch for a newer version, a sample for data or its rate
            limiter, an insert for its rate limiter).
        response_timeout_s: how long a unary call's answer may wait for its client
            to take it; one not taken is dropped (the call ends, its memory is freed).
        request_timeout_s: how long a call may take to send its first message (a
            unary call's request, a stream's opening message), and a chunked request
            each next message; one that does not is ended (DEADLINE_EXCEEDED), its
            slot and memory freed.
        memory_wait_s: how long a unary or chunked call may wait for room in the
            memory budget (served in turn per address) before it is refused as
            overloaded.
        max_call_resets_per_s: calls one connection may end before their first
            message (a reset: HTTP/2 rapid reset) within a second; past it the
            connection is cut.
        max_control_bytes_per_s: bytes one connection may send within a second that
            carry no call (HTTP/2 control frames: SETTINGS, WINDOW_UPDATE, PRIORITY,
            PING; beyond an allowance per call, message and byte received); past it
            the connection is cut.
        max_connections: open client connections; more are closed at once.
        idle_timeout_s: a connection that made calls is closed after this long
            without one.
        handshake_timeout_s: a connection that has made no call this long after
            it was accepted is closed (health checks do not count; with a token,
            only calls carrying it do); ``idle_timeout_s`` if that is shorter.
        max_idle_connections_per_host: connections that have made no call yet
            one source address may hold; more are closed, the oldest first.
        keepalive_s: the server pings every connection (HTTP/2 PING) every this many
            seconds, so that a peer that vanished without closing its connection
            (power loss, partition) is found dead; clients may ping as often as every
            ``min(keepalive_s, 10)`` seconds.
        keepalive_timeout_s: a connection whose ping is not answered within this
            many seconds is closed, ending its calls (a stream's leased rows go back
            to the queue): a vanished learner's rows stay leased at most
            ``keepalive_s + keepalive_timeout_s``.
        max_batch_mb: largest batch (or group of batches) one Sample call or
            SampleStream draws, in MiB; at most 3/8 of ``memory_budget_mb``.
        shared_memory_mb: bytes all shared-memory rings together may take in
            /dev/shm, with the device memory of CUDA IPC rings, in MiB; a stream whose
            ring would not fit uses gRPC.
        table_memory_mb: memory all tables together may take at their
            capacity, in MiB; 0: this machine's memory (or its cgroup's limit).
        metrics_address: ``host:port`` of the Prometheus ``/metrics`` endpoint
            (plain HTTP); ``None``: no metrics.
        tls_cert_file: PEM certificate chain the server presents (TLS on when set,
            with ``tls_key_file``).
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_client_ca_file: PEM CA certificates that sign client certificates:
            mutual TLS, every connection must present one (needs TLS on).
        allow_plaintext_token: accept the auth token over a plaintext channel on a
            non-loopback address (it can be read on the network); without TLS a
            server with a token otherwise listens on loopback only.
        health_address: ``host:port`` of an extra plaintext listener serving only
            ``grpc.health.v1.Health`` (for probes that cannot speak TLS, such as
            Kubernetes' gRPC probes); ``None``: health on ``address`` only.
        wal: log every acknowledged change before answering (docs/durability.md).
        wal_sync: ``"fsync"`` (on disk: survives power loss) or ``"os"`` (in the OS's
            file cache: survives a crash of the process).
        wal_dir: where the log goes; ``None``: ``checkpoint_dir``.
        wal_max_mb: the log's bound; past it a checkpoint truncates it, or writes are refused.
    """

    address: str = DEFAULT_ADDRESS
    pin_memory: str = "auto"
    auth_token_env: str | None = None
    max_message_mb: int = 4
    workers: int = 4
    log_format: str = "text"
    shared_memory: bool = True
    checkpoint_dir: str | None = None
    checkpoint_interval_s: float = 600.0
    keep_latest: int = 3
    tables: tuple[TableConfig, ...] = field(default_factory=lambda: tuple(default_table_configs()))
    variables_max_mb: int = 256
    shard: int | str = 0
    start_empty_if_unrestorable: bool = False
    memory_budget_mb: int = LIMIT_DEFAULTS["memory_budget_mb"]
    max_concurrent_calls: int = LIMIT_DEFAULTS["max_concurrent_calls"]
    max_connections: int = LIMIT_DEFAULTS["max_connections"]
    idle_timeout_s: float = LIMIT_DEFAULTS["idle_timeout_s"]
    handshake_timeout_s: float = LIMIT_DEFAULTS["handshake_timeout_s"]
    max_idle_connections_per_host: int = LIMIT_DEFAULTS["max_idle_connections_per_host"]
    max_waiting_calls: int = LIMIT_DEFAULTS["max_waiting_calls"]
    max_streams: int = LIMIT_DEFAULTS["max_streams"]
    max_host_share: float = LIMIT_DEFAULTS["max_host_share"]
    default_wait_s: float = LIMIT_DEFAULTS["default_wait_s"]
    response_timeout_s: float = LIMIT_DEFAULTS["response_timeout_s"]
    request_timeout_s: float = LIMIT_DEFAULTS["request_timeout_s"]
    max_call_resets_per_s: float = LIMIT_DEFAULTS["max_call_resets_per_s"]
    memory_wait_s: float = LIMIT_DEFAULTS["memory_wait_s"]
    max_control_bytes_per_s: int = LIMIT_DEFAULTS["max_control_bytes_per_s"]
    keepalive_s: float = LIMIT_DEFAULTS["keepalive_s"]
    keepalive_timeout_s: float = LIMIT_DEFAULTS["keepalive_timeout_s"]
    max_batch_mb: int = LIMIT_DEFAULTS["max_batch_mb"]
    shared_memory_mb: int = LIMIT_DEFAULTS["shared_memory_mb"]
    table_memory_mb: int = 0
    metrics_address: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    allow_plaintext_token: bool = False
    health_address: str | None = None
    wal: bool = False
    wal_sync: str = "fsync"
    wal_dir: str | None = None
    wal_max_mb: int = 1024

    @property
    def shard_index(self) -> int:
        """``shard`` as the index it resolved to (``"auto"`` is resolved when made)."""
        assert isinstance(self.shard, int), self.shard
        return self.shard

    def __post_init__(self) -> None:
        _check_address("server.address", self.address)
        if self.pin_memory not in ("auto", "true", "false"):
            raise ConfigError(
                f"server.pin_memory must be 'auto', 'true' or 'false', got {self.pin_memory!r}"
            )
        if self.pin_memory == "true" and not cuda_present():
            raise ConfigError(
                "server.pin_memory is 'true' but no CUDA device is available; use 'auto' to pin "
                "only where an accelerator is present, or 'false'"
            )
        if self.auth_token_env is not None and (
            not isinstance(self.auth_token_env, str) or not self.auth_token_env
        ):
            raise ConfigError(
                f"server.auth_token_env must name an environment variable, got "
                f"{self.auth_token_env!r}"
            )
        _check_int("server.max_message_mb", self.max_message_mb, 1, 2047)
        _check_int("server.workers", self.workers, 1, 256)
        if not isinstance(self.shared_memory, bool):
            raise ConfigError(f"server.shared_memory must be true or false, got {self.shared_memory!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"server.log_format must be 'text' or 'json', got {self.log_format!r}")
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir
        ):
            raise ConfigError(
                f"server.checkpoint_dir must be a directory path, got {self.checkpoint_dir!r}")
        interval = self.checkpoint_interval_s
        if not is_real(interval) or not 0 <= interval < float("inf"):
            raise ConfigError(
                f"server.checkpoint_interval_s must be a number of seconds >= 0 (0: only on "
                f"request and at shutdown), got {interval!r}")
        _check_int("server.keep_latest", self.keep_latest, 1, 1_000_000)
        _check_int("server.variables_max_mb", self.variables_max_mb, 0, 1 << 20)
        object.__setattr__(self, "shard", resolve_shard(self.shard))
        check_limits(self)
        _check_wal(self)
        names = [t.name for t in self.tables]
        if not names:
            raise ConfigError("the config declares no [[tables]]")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"table names must be unique; repeated: {duplicates}")
        check_security(self)

    @property
    def pinned(self) -> bool:
        """Whether table storage is pinned, ``pin_memory`` resolved."""
        return self.pin_memory == "true" or (
            self.pin_memory == "auto" and cuda_present()
        )

    @property
    def table_configs(self) -> tuple[TableConfig, ...]:
        """The tables, each with ``pin_memory`` resolved from the server's setting.

        ``"auto"`` pins only the tables whose storage can be pinned (not a table
        with every column on memmap: its own rule refuses it; a compressed
        table's plain columns are pinned); ``"true"`` asks it of every table, so
        such a table is refused at start, naming why.
        """
        if not self.pinned:
            return tuple(replace(t, pin_memory=False) for t in self.tables)
        if self.pin_memory == "true":
            return tuple(replace(t, pin_memory=True) for t in self.tables)
        return tuple(_pinned_if_possible(t) for t in self.tables)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    @property
    def variables_max_bytes(self) -> int:
        return self.variables_max_mb * 1024 * 1024

    @property
    def tls(self) -> bool:
        """Whether the server listens with TLS."""
        return self.tls_cert_file is not None


def _pinned_if_possible(table: TableConfig) -> TableConfig:
    """``table`` with pinned storage, or as it is where its options cannot be pinned."""
    try:
        return replace(table, pin_memory=True)
    except ConfigError:
        return replace(table, pin_memory=False)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not is_int(value) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_address(name: str, value: Any) -> None:
    if not isinstance(value, str) or not _ADDRESS.match(value) or not (
        0 <= int(value.rsplit(":", 1)[1]) <= 65535
    ):
        raise ConfigError(f"{name} must be 'host:port', got {value!r}")


def _check_wal(settings: ServerSettings) -> None:
    if not isinstance(settings.wal, bool):
        raise ConfigError(f"server.wal must be true or false, got {settings.wal!r}")
    if settings.wal_sync not in ("fsync", "os"):
        raise ConfigError(f"server.wal_sync must be 'fsync' (survives power loss) or 'os' "
                          f"(survives a crash of the process), got {settings.wal_sync!r}")
    if settings.wal_dir is not None and (not isinstance(settings.wal_dir, str)
                                         or not settings.wal_dir):
        raise ConfigError(f"server.wal_dir must be a directory path, got {settings.wal_dir!r}")
    _check_int("server.wal_max_mb", settings.wal_max_mb, 1, 1 << 30)
    if settings.wal and settings.checkpoint_dir is None and settings.wal_dir is None:
        raise ConfigError("server.wal = true needs a place for the log: set server.checkpoint_dir "
                          "(the log goes there, and checkpoints truncate it) or server.wal_dir")


def check_security(settings: ServerSettings) -> None:
    """The listeners and TLS files are well-formed, and a token never crosses a network in clear.

    Only the shape is checked here; :mod:`replay_server.service.credentials`
    reads the files when the server starts.
    """
    for name in ("metrics_address", "health_address"):
        value = getattr(settings, name)
        if value is not None:
            _check_address(f"server.{name}", value)
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        value = getattr(settings, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"server.{name} must be a file path, got {value!r}")
    if (settings.tls_cert_file is None) != (settings.tls_key_file is None):
        raise ConfigError("server.tls_cert_file and server.tls_key_file go together: set both "
                          "(TLS) or neither (plaintext)")
    if settings.tls_client_ca_file is not None and not settings.tls:
        raise ConfigError("server.tls_client_ca_file (mutual TLS) needs TLS: set "
                          "server.tls_cert_file and server.tls_key_file too")
    if not isinstance(settings.allow_plaintext_token, bool):
        raise ConfigError(f"server.allow_plaintext_token must be true or false, got "
                          f"{settings.allow_plaintext_token!r}")
    if (settings.auth_token_env is not None and not settings.tls
            and not settings.allow_plaintext_token and not is_loopback(settings.address)):
        raise ConfigError(
            f"server.auth_token_env is set but TLS is off and server.address "
            f"{settings.address!r} is reachable from other hosts: clients would send the token "
            f"in clear text. Set server.tls_cert_file and server.tls_key_file, or "
            f"server.allow_plaintext_token = true to accept that on a trusted network")
