"""The server process: tables, the gRPC server, health, auth, TLS, metrics and shutdown."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from replay_proto.v1 import replay_pb2 as pb
from replay_server.checkpoint import Checkpointer, CheckpointResult, RestoreCancelled
from replay_server.checkpoint.incarnation import IncarnationFile
from replay_server.checkpoint.reader import read_manifest
from replay_server.checkpoint.wal.keeper import LogKeeper
from replay_server.checkpoint.wal.logged_table import LoggedTable
from replay_server.checkpoint.wal.logged_variables import LoggedVariableStore
from replay_server.engine import (
    IncarnationSource,
    MemoryLedger,
    RandomIncarnations,
    TableSet,
    VariableStore,
    format_bytes,
)
from replay_server.errors import CheckpointWriteError, ConfigError
from replay_server.service.admission import Admission
from replay_server.service.budget import MemoryBudget
from replay_server import grpc_experiments
from replay_server.service import control_meter
from replay_server.service.connections import ConnectionGuard
from replay_server.service.control_meter import ControlMeter
from replay_server.service.limits import MIB, ServiceLimits
from replay_server.service.listener import listen
from replay_server.service.credentials import server_credentials
from replay_server.service.loop import loop_name
from replay_server.service.metrics import MetricsSource, ServerMetrics
from replay_server.service.reset_meter import ResetMeter
from replay_server.service.servicer import SERVICE_NAME, ReplayServicer
from replay_server.service import sinks
from replay_server.service.settings import ServerSettings
from replay_server.service.token_auth import TokenAuth
from replay_server.service.status import CLIENT_LOG

log = logging.getLogger("replay_server")

LEASE_CLOCK_S = 0.5
"""How often the rows of expired leases are returned to their queues (without a sample)."""

T = TypeVar("T")


class ReplayServer:
    """Owns the tables and serves them over gRPC until stopped.

    Health (``grpc.health.v1.Health``, service names ``""`` and
    ``replay.v1.ReplayService``) is NOT_SERVING while the tables are being
    restored from the newest checkpoint (replay calls get UNAVAILABLE), then
    SERVING, and NOT_SERVING again while draining; ``health_address`` adds a
    plaintext listener serving health alone. With ``tls_cert_file`` the
    listener speaks TLS (:mod:`~replay_server.service.credentials`); with
    ``metrics_address`` every call is counted and ``/metrics`` served
    (:mod:`~replay_server.service.metrics`).

    Args:
        settings: validated server settings.

    Ids: with a checkpoint_dir, the run's id incarnation is taken from its
    ``INCARNATION`` counter (written durably) before anything is served;
    without one it is random (see :mod:`replay_server.engine.id_space`).

    Raises:
        ConfigError: the auth token variable is unset, a table config is
            invalid (or needs more memory than ``table_memory_mb``), the
            checkpoint directory or its incarnation counter cannot be used, or a
            TLS file cannot be read or does not match.
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.limits = ServiceLimits.of(settings)
        self._token = _auth_token(settings)  # before anything is opened that it would leave open
        self.checkpointer: Checkpointer | None = None
        self.incarnations: IncarnationSource = RandomIncarnations(settings.shard_index)
        self._open_storage()
        self._auth = TokenAuth(self._token) if self._token else None
        self.exit_code = 0  # 1 when the final checkpoint failed
        self._executor = ThreadPoolExecutor(settings.workers, thread_name_prefix="replay-engine")
        # Checkpoints block their thread for seconds: never on the engine's workers.
        self._checkpoint_executor = ThreadPoolExecutor(2, thread_name_prefix="replay-checkpoint")
        self.admission = Admission(self.limits, MemoryBudget(self.limits.memory_budget_bytes))
        self._info = _server_info(settings, self._token)  # Info's ServerInfo, kept current
        self._servicer = ReplayServicer(
            self.tables, self._executor, settings.max_message_bytes,
            shared_memory=settings.shared_memory, checkpointer=self.checkpointer,
            checkpoint_executor=self._checkpoint_executor, admission=self.admission,
            incarnations=self.incarnations,
            shared_memory_budget=MemoryBudget(self.limits.shared_memory_bytes,
                                              "server.shared_memory_mb", bulk_share=1.0),
            variables=self._make_variables(),
            server_info=self._info)
        self._health = health.aio.HealthServicer()
        self._credentials = server_credentials(settings)
        self.metrics: ServerMetrics | None = None
        if settings.metrics_address is not None:
            self.metrics = ServerMetrics(settings.metrics_address, MetricsSource(
                tables=lambda: self.tables, blocked=self._servicer.calls.blocked.totals,
                streams=self._servicer.stream_transports, checkpointer=self.checkpointer,
                version=server_version()))
            self._servicer.call_streams.counted = self.metrics.rpc.carried
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.connections: ConnectionGuard | None = None
        self._timer: asyncio.Task | None = None
        self._leases: asyncio.Task | None = None
        self._restored = False
        self.port: int | None = None

    def _open_storage(self) -> None:
        """The checkpoint directory, the write-ahead log, the incarnation counter and the tables.

        Raises:
            ConfigError: one of them cannot be used (the directory is closed again).
        """
        settings = self.settings
        if settings.checkpoint_dir is not None:
            self.checkpointer = Checkpointer(settings.checkpoint_dir,
                                             keep_latest=settings.keep_latest,
                                             server_version=server_version())
            try:
                self.checkpointer.open()
                self.incarnations = IncarnationFile.claim(self.checkpointer.path, settings.shard_index)
            except ConfigError as exc:
                self.checkpointer.close()
                raise ConfigError(f"server.checkpoint_dir: {exc}") from None
        try:
            self.wal = _log_keeper(settings)
            if self.wal is not None and self.checkpointer is None:
                self.incarnations = IncarnationFile.claim(self.wal.path, settings.shard_index)
            self.tables = self._make_tables()
        except ConfigError:
            if self.checkpointer is not None:
                self.checkpointer.close()
            raise

    def _make_tables(self) -> TableSet:
        mb = self.settings.table_memory_mb
        configured = mb * MIB if mb else None
        limit = self.limits.table_memory_within_address_space(configured)
        if limit is None:
            memory = MemoryLedger()
        elif limit == configured:
            memory = MemoryLedger(limit, "server.table_memory_mb")
        else:  # the address-space limit is the tighter one
            memory = MemoryLedger(limit, "the address space left by ulimit -v (RLIMIT_AS)")
        return TableSet(self.settings.table_configs, self.incarnations, memory, LoggedTable)

    def _make_variables(self) -> VariableStore:
        return LoggedVariableStore(self.settings.variables_max_bytes)

    @property
    def variables(self) -> VariableStore:
        """The named variables (``client.publish``/``fetch``)."""
        return self._servicer.variables.store

    async def start(self, cancel: threading.Event | None = None) -> int:
        """Bind, restore the tables from the newest checkpoint, report SERVING; returns the port.

        While restoring, the server already listens: health answers
        NOT_SERVING and replay calls get UNAVAILABLE. Setting ``cancel``
        stops the restore (:class:`~replay_server.checkpoint.RestoreCancelled`).

        Raises:
            ConfigError: the address cannot be bound, the open-file limit is
                below what ``max_connections`` needs, or the checkpoints cannot
                be restored (see :mod:`replay_server.checkpoint.reader`).
        """
        self.limits.ensure_open_files()
        for sink in sinks.SINKS.values():
            sink.prepare(self.settings)  # e.g. rings that servers gone left in /dev/shm
        self._server = self._grpc_server()
        self.port = listen(self._server, self.settings.address, self._credentials)
        self._start_guard(asyncio.get_running_loop())
        health_port = self._health_listener()
        if self.metrics is not None:
            self.metrics.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._servicer.calls.restoring = self.checkpointer is not None or self.wal is not None
        await self._server.start()
        self._log_listening()
        if self._health_server is not None:
            await self._health_server.start()
            assert self.settings.health_address is not None  # the health server listens there
            log.info("health checks (plaintext, grpc.health.v1 only) on %s:%d",
                     self.settings.health_address.rsplit(":", 1)[0], health_port)
        await self._restore(cancel)
        # What start-up created (modules, tables) is never garbage: out of the cyclic
        # collector's sight, a full collection takes well under a millisecond instead of
        # ~70 ms, a pause every request (and checkpoint) thread would wait out.
        gc.freeze()
        await self._set_health()
        interval = self.settings.checkpoint_interval_s
        if self.checkpointer is not None and interval > 0:
            self._timer = asyncio.create_task(self._checkpoint_every(interval))
        self._leases = asyncio.create_task(self._servicer.expire_leases_every(LEASE_CLOCK_S))
        return self.port

    def _grpc_server(self) -> grpc.aio.Server:
        """The gRPC server with the replay and health services, behind the metrics and token
        interceptors (not bound yet)."""
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.metrics is not None:  # first: it sees the token check's refusals too
            interceptors.append(self.metrics.rpc)
        if self._auth is not None:
            interceptors.append(self._auth)
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[*self.limits.grpc_options(), ("grpc.so_reuseport", 0)],
        )
        server.add_generic_rpc_handlers((self._servicer.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        return server

    def _health_listener(self) -> int | None:
        """Bind the plaintext health-only server on ``health_address`` (started once the main
        one is); its port, or ``None`` without one."""
        if self.settings.health_address is None:
            return None
        self._health_server = grpc.aio.server(options=self.limits.side_listener_options())
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
        return listen(self._health_server, self.settings.health_address, None,
                      "server.health_address: ")

    def _log_listening(self) -> None:
        """The start-up log's lines: where the server listens, how, and its limits."""
        host = self.settings.address.rsplit(":", 1)[0]
        log.info("listening on %s:%d (event loop: %s, engine threads: %d, auth: %s, tls: %s, "
                 "shard %d, id incarnation %d)", host, self.port, loop_name(),
                 self.settings.workers, "token" if self._token else "off",
                 _tls_mode(self.settings), self.settings.shard, self.incarnations.current)
        log.info("limits: %s, tables %s", self.limits.summary(),
                 format_bytes(self.tables.memory.limit))
        sound, why = grpc_experiments.state()
        log.log(logging.INFO if sound else logging.WARNING, "%s", why)

    def _start_guard(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close connections that make no call (:mod:`~replay_server.service.connections`);
        health says NOT_SERVING while the port is full."""
        limits = self.limits

        def on_full(full: bool) -> None:  # on the guard's thread
            asyncio.run_coroutine_threadsafe(self._set_health(), loop)

        assert self.port is not None  # listening
        control = self._control_meter()
        self.connections = ConnectionGuard(
            self.port, handshake_timeout_s=limits.handshake_timeout_s,
            max_idle_per_host=limits.max_idle_connections_per_host,
            max_idle=limits.max_idle_connections, max_connections=limits.max_connections,
            on_full=on_full, control=control)
        called = self.connections.called
        if control is None:
            self.admission.on_call = called
        else:
            def on_call(peer: str) -> None:  # on the event loop
                called(peer)
                control.called(peer)

            self.admission.on_call = on_call
            self.admission.on_message = control.message
            self.admission.on_unread = control.refused
            self.admission.on_expect = control.expect
        meter = ResetMeter(limits.max_call_resets_per_s)

        def on_silent_end(peer: str) -> None:  # on the event loop
            if meter.ended_silent(peer):
                CLIENT_LOG.log(peer, "resets", logging.WARNING, "%s ended more than "
                               "server.max_call_resets_per_s = %g calls within a second before "
                               "their first message (HTTP/2 rapid reset?): its connection is "
                               "closed", peer, limits.max_call_resets_per_s)
                guard.cut(peer)

        def on_refused(peer: str) -> None:  # on the event loop
            if meter.ended_silent(peer):
                CLIENT_LOG.log(peer, "resets", logging.WARNING, "%s made more than "
                               "server.max_call_resets_per_s = %g calls without the token within "
                               "a second: its connection is closed", peer,
                               limits.max_call_resets_per_s)
                guard.cut(peer)

        self.admission.on_silent_end = on_silent_end
        if self._auth is not None:
            self._auth.on_refused = on_refused
        guard = self.connections
        self._servicer.connection_figures = lambda: (guard.open, guard.closed)
        self.connections.start()

    def _control_meter(self) -> ControlMeter | None:
        """The control-frame meter (:mod:`~replay_server.service.control_meter`), or ``None``
        (said in the log) where the kernel does not count a socket's bytes."""
        if not (ConnectionGuard.supported() and control_meter.supported()):
            log.info("HTTP/2 control frames (SETTINGS, WINDOW_UPDATE, PRIORITY) are not "
                     "metered on this platform (no TCP_INFO byte counts): "
                     "server.max_control_bytes_per_s does not apply")
            return None
        return ControlMeter(self.limits.max_control_bytes_per_s)

    async def _set_health(self) -> None:
        """SERVING once restored, unless draining or the port is full (new clients refused)."""
        serving = (self._restored and not self._servicer.calls.draining
                   and (self.connections is None or not self.connections.full))
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _restore(self, cancel: threading.Event | None) -> None:
        if self.checkpointer is not None:
            await self._restore_checkpoint(cancel)
        if self.wal is not None:
            await _cancellable(functools.partial(self._replay, cancel), cancel)
        self._restored = True
        self._servicer.calls.restoring = False

    def _replay(self, cancel: threading.Event | None) -> None:
        """Restore's second half: the write-ahead log after the checkpoint, then this run's log."""
        assert self.wal is not None
        restored = self._info.restored_checkpoint
        manifest = read_manifest(Path(restored)) if restored else None
        variables = self.variables
        assert isinstance(variables, LoggedVariableStore)
        report = self.wal.replay(self.tables, manifest, self.incarnations.current - 1, cancel,
                                 variables)
        if report.segments:
            log.info("replayed the write-ahead log: %d change(s) from %d segment(s) (%.1f MB in "
                     "%.2f s; %d already in the checkpoint)%s", report.applied, report.segments,
                     report.nbytes / 1e6, report.seconds, report.skipped,
                     "".join(f"; {cut}" for cut in report.cut))
        wal = self.wal.start(self.tables, self.incarnations.current,
                             None if self.checkpointer is None else self._checkpoint, variables)
        if self.checkpointer is not None:
            self.checkpointer.log = wal

    async def _restore_checkpoint(self, cancel: threading.Event | None) -> None:
        assert self.checkpointer is not None
        # The first attempt loads into the tables made at start, which hold no row yet, so
        # their storage is loaded into (no second copy: memmap tables fit a disk sized for
        # one); only a retry after a damaged checkpoint makes new ones.
        initial = [self.tables]

        def make_tables() -> TableSet:
            return initial.pop() if initial else self._make_tables()

        restored = await _cancellable(functools.partial(
            self.checkpointer.restore, make_tables, cancel, self._make_variables,
            start_empty=self.settings.start_empty_if_unrestorable), cancel)
        if restored is None:
            if not initial:  # loaded into by a failed attempt: start from new, empty ones
                self.tables = None  # type: ignore[assignment]  # dropped before remade
                self.tables = self._make_tables()
                self._servicer.use_tables(self.tables)
            log.info("nothing restored from %s: starting with empty tables",
                     self.checkpointer.path)
        else:
            self.tables, result = restored
            self._servicer.use_tables(self.tables)
            if result.variables is not None:
                self._servicer.variables.use_store(result.variables)
            self._info.restored_checkpoint = str(result.path)
            rows = sum(t.rows for t in result.manifest.tables)
            log.info("restored %d table(s) from %s (%d rows, %.1f MB in %.2f s)",
                     len(result.manifest.tables), result.path, rows,
                     result.manifest.nbytes / 1e6, result.seconds)

    def _checkpoint(self, reason: str) -> CheckpointResult:
        assert self.checkpointer is not None
        return self.checkpointer.checkpoint(self.tables, reason, variables=self.variables)

    async def _checkpoint_every(self, interval: float) -> None:
        """Timed checkpoints, ``interval`` seconds after the end of the previous one."""
        assert self.checkpointer is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                await loop.run_in_executor(self._checkpoint_executor, self._checkpoint,
                                           "timer")
            except CheckpointWriteError:
                pass  # logged by the checkpointer; the next tick tries again

    async def stop(self, grace: float = 10.0, *, checkpoint: bool = True) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let in-flight ones finish within
        ``grace``, then write a final checkpoint (if ``checkpoint`` and the server has a
        checkpoint_dir and finished restoring). A failed final checkpoint sets
        ``exit_code`` to 1."""
        if self._server is None:
            return
        self._servicer.calls.draining = True
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._timer is not None:
            self._timer.cancel()
        if self._leases is not None:
            self._leases.cancel()
        await self._server.stop(grace)
        self._executor.shutdown(wait=True)
        if checkpoint and self.checkpointer is not None and self._restored:
            loop = asyncio.get_running_loop()
            try:
                result = await loop.run_in_executor(self._checkpoint_executor,
                                                    self._checkpoint, "shutdown")
            except CheckpointWriteError:
                self.exit_code = 1  # logged by the checkpointer
            else:
                # Written without the named variables only: the tables are saved, a clean
                # stop (logged at ERROR). Without a table: rows would be lost, exit 1.
                self.exit_code = 1 if result.lost_tables else 0
        self._checkpoint_executor.shutdown(wait=True)
        if self.wal is not None:
            self.wal.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        if self.metrics is not None:
            self.metrics.stop()
        if self.connections is not None:
            self.connections.stop()
        self._server = None
        log.info("stopped")

    async def serve(self, *, port_file: Path | None = None, grace: float = 10.0) -> None:
        """Start (restoring), then run until SIGTERM or SIGINT; a second signal exits at once.

        The port is written to ``port_file`` once the server is SERVING.
        """
        stop = asyncio.Event()
        cancel = threading.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                os._exit(1)
            log.info("%s received: draining (grace %.0f s)", signal.Signals(signum).name, grace)
            stop.set()
            cancel.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            port = await self.start(cancel)
        except RestoreCancelled:
            log.info("stopped while restoring: no checkpoint written (those on disk are untouched)")
            await self.stop(grace, checkpoint=False)
            return
        except BaseException:
            await self.stop(0, checkpoint=False)
            raise
        if port_file is not None:
            port_file.write_text(f"{port}\n")
        await stop.wait()
        await self.stop(grace)


RESTORE_STOP_S = 5.0
"""How long a restore told to stop may take to notice; one blocked in a system call (a hung
network file system) is left behind after that, and the server stops without it."""


async def _cancellable(restore: Callable[[], T], cancel: threading.Event | None) -> T:
    """``restore()`` on a daemon thread of its own; once ``cancel`` is set, it has
    :data:`RESTORE_STOP_S` to return (or raise), else :class:`RestoreCancelled` is raised
    here and the thread is abandoned (a daemon: it never holds up the process' exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = restore()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, functools.partial(future.set_exception, exc))
        else:
            loop.call_soon_threadsafe(settle, functools.partial(future.set_result, result))

    threading.Thread(target=run, name="replay-restore", daemon=True).start()
    while not future.done():
        await asyncio.wait({future}, timeout=0.1)
        if cancel is not None and cancel.is_set() and not future.done():
            done, _ = await asyncio.wait({future}, timeout=RESTORE_STOP_S)
            if not done:
                log.warning("the restore did not stop within %.0f s of the signal (blocked "
                            "reading the checkpoint?): leaving it behind", RESTORE_STOP_S)
                raise RestoreCancelled("restore cancelled (it did not stop in time)")
    return future.result()


def _auth_token(settings: ServerSettings) -> str | None:
    """The token clients must send (``server.auth_token_env``'s variable); ``None``: no auth.

    Raises:
        ConfigError: the variable is named but unset or empty.
    """
    if settings.auth_token_env is None:
        return None
    token = os.environ.get(settings.auth_token_env)
    if not token:
        raise ConfigError(f"server.auth_token_env is {settings.auth_token_env!r} but that "
                          f"environment variable is unset or empty")
    return token


def _server_info(settings: ServerSettings, token: str | None) -> pb.ServerInfo:
    return pb.ServerInfo(version=server_version(), tls=settings.tls,
                         mutual_tls=settings.tls_client_ca_file is not None, auth=bool(token),
                         checkpoint_dir=str(Path(settings.checkpoint_dir).resolve())
                         if settings.checkpoint_dir else "",
                         wal=settings.wal_sync if settings.wal else "off")


def _log_keeper(settings: ServerSettings) -> LogKeeper | None:
    """The write-ahead log's keeper, its directory opened (``None``: no directory for one)."""
    path = settings.wal_dir or settings.checkpoint_dir
    if path is None:
        return None
    own = settings.wal_dir is not None and (
        settings.checkpoint_dir is None
        or Path(settings.wal_dir).resolve() != Path(settings.checkpoint_dir).resolve())
    keeper = LogKeeper(Path(path), enabled=settings.wal, sync=settings.wal_sync,
                       max_bytes=settings.wal_max_mb * MIB, shard=settings.shard_index, lock=own)
    keeper.open()
    return keeper


def _tls_mode(settings: ServerSettings) -> str:
    if not settings.tls:
        return "off"
    return "mutual (client certificates required)" if settings.tls_client_ca_file else "on"


def server_version() -> str:
    """The installed replay-server version (recorded in checkpoint manifests)."""
    try:
        return metadata.version("replay-server")
    except metadata.PackageNotFoundError:
        return "unknown"
