"""The server process: tables, the gRPC server, health, auth and shutdown."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from replay_feed.shared_ring import sweep_stale_rings
from replay_server.checkpoint import Checkpointer, RestoreCancelled
from replay_server.checkpoint.incarnation import IncarnationFile
from replay_server.engine.id_space import IncarnationSource, RandomIncarnations
from replay_server.engine.memory import MemoryLedger, format_bytes
from replay_server.engine.table_set import TableSet
from replay_server.engine.variables import VariableStore
from replay_server.errors import CheckpointWriteError, ConfigError
from replay_server.service.admission import Admission
from replay_server.service.budget import MemoryBudget
from replay_server.service.limits import MIB, ServiceLimits
from replay_server.service.loop import loop_name
from replay_server.service.servicer import SERVICE_NAME, ReplayServicer
from replay_server.service.settings import ServerSettings
from replay_server.service.status import UnauthenticatedError, abort

log = logging.getLogger("replay_server")

HEALTH_SERVICE = "grpc.health.v1.Health"


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (health checks excepted).

    The refusal never reads the request: it is served by a *stream* handler
    (a unary one would have gRPC read the whole message first), so a flood
    of large calls without the token costs no memory.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        async def refuse(requests: object, context: grpc.aio.ServicerContext) -> bytes:
            await abort(context, UnauthenticatedError(
                "missing or wrong token: send metadata 'authorization: Bearer <token>'"))

        self._refuse = grpc.stream_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.stream_stream_rpc_method_handler(refuse)

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(details)
        return self._refuse_stream if details.method.endswith("/SampleStream") else self._refuse


class ReplayServer:
    """Owns the tables and serves them over gRPC until stopped.

    Health (``grpc.health.v1.Health``, service names ``""`` and
    ``replay.v1.ReplayService``) is NOT_SERVING while the tables are being
    restored from the newest checkpoint (replay calls get UNAVAILABLE), then
    SERVING, and NOT_SERVING again while draining.

    Args:
        settings: validated server settings.

    Ids: with a checkpoint_dir, the run's id incarnation is taken from its
    ``INCARNATION`` counter (written durably) before anything is served;
    without one it is random (see :mod:`replay_server.engine.id_space`).

    Raises:
        ConfigError: the auth token variable is unset, a table config is
            invalid (or needs more memory than ``table_memory_mb``), the
            checkpoint directory or its incarnation counter cannot be used.
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.limits = ServiceLimits.of(settings)
        self.checkpointer: Checkpointer | None = None
        self.incarnations: IncarnationSource = RandomIncarnations(settings.shard)
        if settings.checkpoint_dir is not None:
            self.checkpointer = Checkpointer(settings.checkpoint_dir,
                                             keep_latest=settings.keep_latest,
                                             server_version=server_version())
            try:
                self.checkpointer.open()
                self.incarnations = IncarnationFile.claim(self.checkpointer.path, settings.shard)
            except ConfigError as exc:
                self.checkpointer.close()
                raise ConfigError(f"server.checkpoint_dir: {exc}") from None
        try:
            self.tables = self._make_tables()
        except ConfigError:
            if self.checkpointer is not None:
                self.checkpointer.close()
            raise
        self._token = None
        if settings.auth_token_env is not None:
            self._token = os.environ.get(settings.auth_token_env)
            if not self._token:
                raise ConfigError(
                    f"server.auth_token_env is {settings.auth_token_env!r} but that environment "
                    f"variable is unset or empty"
                )
        self.exit_code = 0  # 1 when the final checkpoint failed
        self._executor = ThreadPoolExecutor(settings.workers, thread_name_prefix="replay-engine")
        # Checkpoints block their thread for seconds: never on the engine's workers.
        self._checkpoint_executor = ThreadPoolExecutor(2, thread_name_prefix="replay-checkpoint")
        self.admission = Admission(self.limits, MemoryBudget(self.limits.memory_budget_bytes))
        self._servicer = ReplayServicer(
            self.tables, self._executor, settings.max_message_bytes,
            shared_memory=settings.shared_memory, checkpointer=self.checkpointer,
            checkpoint_executor=self._checkpoint_executor, admission=self.admission,
            incarnations=self.incarnations,
            shared_memory_budget=MemoryBudget(self.limits.shared_memory_bytes,
                                              "server.shared_memory_mb", bulk_share=1.0),
            variables=self._make_variables())
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._timer: asyncio.Task | None = None
        self._restored = False
        self.port: int | None = None

    def _make_tables(self) -> TableSet:
        mb = self.settings.table_memory_mb
        memory = MemoryLedger(mb * MIB, "server.table_memory_mb") if mb else MemoryLedger()
        return TableSet(self.settings.table_configs, self.incarnations, memory)

    def _make_variables(self) -> VariableStore:
        return VariableStore(self.settings.variables_max_bytes)

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
        if self.settings.shared_memory:
            for name in sweep_stale_rings():
                log.warning("removed shared-memory ring %s left by a server that is gone", name)
        interceptors = [_TokenAuth(self._token)] if self._token else []
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[*self.limits.grpc_options(), ("grpc.so_reuseport", 0)],
        )
        self._server.add_generic_rpc_handlers((self._servicer.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        try:
            self.port = self._server.add_insecure_port(self.settings.address)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {self.settings.address}: {exc}") from None
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._servicer.calls.restoring = self.checkpointer is not None
        await self._server.start()
        host = self.settings.address.rsplit(":", 1)[0]
        log.info("listening on %s:%d (event loop: %s, engine threads: %d, auth: %s, shard %d, "
                 "id incarnation %d)", host, self.port, loop_name(), self.settings.workers,
                 "token" if self._token else "off", self.settings.shard,
                 self.incarnations.current)
        limits = self.limits
        log.info("limits: calls may hold %s at once, %d calls, %d connections (idle %.0f s), "
                 "batches up to %s, shared-memory rings %s, tables %s",
                 format_bytes(limits.memory_budget_bytes), limits.max_concurrent_calls,
                 limits.max_connections, limits.idle_timeout_s,
                 format_bytes(limits.max_batch_bytes), format_bytes(limits.shared_memory_bytes),
                 format_bytes(self.tables.memory.limit))
        await self._restore(cancel)
        # What start-up created (modules, tables) is never garbage: out of the cyclic
        # collector's sight, a full collection takes well under a millisecond instead of
        # ~70 ms, a pause every request (and checkpoint) thread would wait out.
        gc.freeze()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        interval = self.settings.checkpoint_interval_s
        if self.checkpointer is not None and interval > 0:
            self._timer = asyncio.create_task(self._checkpoint_every(interval))
        return self.port

    async def _restore(self, cancel: threading.Event | None) -> None:
        if self.checkpointer is None:
            self._restored = True
            return
        loop = asyncio.get_running_loop()
        restored = await loop.run_in_executor(
            self._checkpoint_executor, functools.partial(
                self.checkpointer.restore, self._make_tables, cancel, self._make_variables,
                start_empty=self.settings.start_empty_if_unrestorable))
        if restored is None:
            log.info("nothing restored from %s: starting with empty tables",
                     self.checkpointer.path)
        else:
            self.tables, result = restored
            self._servicer.use_tables(self.tables)
            if result.variables is not None:
                self._servicer.variables.use_store(result.variables)
            rows = sum(t.rows for t in result.manifest.tables)
            log.info("restored %d table(s) from %s (%d rows, %.1f MB in %.2f s)",
                     len(result.manifest.tables), result.path, rows,
                     result.manifest.nbytes / 1e6, result.seconds)
        self._restored = True
        self._servicer.calls.restoring = False

    def _checkpoint(self, reason: str) -> None:
        assert self.checkpointer is not None
        self.checkpointer.checkpoint(self.tables, reason, variables=self.variables)

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
        await self._server.stop(grace)
        self._executor.shutdown(wait=True)
        if checkpoint and self.checkpointer is not None and self._restored:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._checkpoint_executor, self._checkpoint,
                                           "shutdown")
            except CheckpointWriteError:
                self.exit_code = 1  # logged by the checkpointer
        self._checkpoint_executor.shutdown(wait=True)
        if self.checkpointer is not None:
            self.checkpointer.close()
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


def server_version() -> str:
    """The installed replay-server version (recorded in checkpoint manifests)."""
    try:
        return metadata.version("replay-server")
    except metadata.PackageNotFoundError:
        return "unknown"
