"""The server process: tables, the gRPC server, health, auth and shutdown."""

from __future__ import annotations

import asyncio
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

from replay_server.checkpoint import Checkpointer, RestoreCancelled
from replay_server.errors import CheckpointWriteError, ConfigError
from replay_server.service.loop import loop_name
from replay_server.service.servicer import SERVICE_NAME, ReplayServicer
from replay_server.service.settings import ServerSettings
from replay_server.service.status import UnauthenticatedError, abort
from replay_server.engine.table_set import TableSet

log = logging.getLogger("replay_server")

HEALTH_SERVICE = "grpc.health.v1.Health"


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (health checks excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await abort(context, UnauthenticatedError(
                "missing or wrong token: send metadata 'authorization: Bearer <token>'"))

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.stream_stream_rpc_method_handler(refuse)

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(details)
        streaming = details.method.endswith(("/SampleStream", "/UpdateStream"))
        return self._refuse_stream if streaming else self._refuse


class ReplayServer:
    """Owns the tables and serves them over gRPC until stopped.

    Health (``grpc.health.v1.Health``, service names ``""`` and
    ``replay.v1.ReplayService``) is NOT_SERVING while the tables are being
    restored from the newest checkpoint (replay calls get UNAVAILABLE), then
    SERVING, and NOT_SERVING again while draining.

    Args:
        settings: validated server settings.

    Raises:
        ConfigError: the auth token variable is unset, a table config is
            invalid, or the checkpoint directory cannot be used.
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.tables = self._make_tables()
        self._token = None
        if settings.auth_token_env is not None:
            self._token = os.environ.get(settings.auth_token_env)
            if not self._token:
                raise ConfigError(
                    f"server.auth_token_env is {settings.auth_token_env!r} but that environment "
                    f"variable is unset or empty"
                )
        self.checkpointer: Checkpointer | None = None
        if settings.checkpoint_dir is not None:
            self.checkpointer = Checkpointer(settings.checkpoint_dir,
                                             keep_latest=settings.keep_latest,
                                             server_version=server_version())
            try:
                self.checkpointer.open()
            except ConfigError as exc:
                raise ConfigError(f"server.checkpoint_dir: {exc}") from None
        self.exit_code = 0  # 1 when the final checkpoint failed
        self._executor = ThreadPoolExecutor(settings.workers, thread_name_prefix="replay-engine")
        # Checkpoints block their thread for seconds: never on the engine's workers.
        self._checkpoint_executor = ThreadPoolExecutor(2, thread_name_prefix="replay-checkpoint")
        self._servicer = ReplayServicer(self.tables, self._executor, settings.max_message_bytes,
                                        shared_memory=settings.shared_memory,
                                        checkpointer=self.checkpointer,
                                        checkpoint_executor=self._checkpoint_executor)
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._timer: asyncio.Task | None = None
        self._restored = False
        self.port: int | None = None

    def _make_tables(self) -> TableSet:
        return TableSet(self.settings.table_configs)

    async def start(self, cancel: threading.Event | None = None) -> int:
        """Bind, restore the tables from the newest checkpoint, report SERVING; returns the port.

        While restoring, the server already listens: health answers
        NOT_SERVING and replay calls get UNAVAILABLE. Setting ``cancel``
        stops the restore (:class:`~replay_server.checkpoint.RestoreCancelled`).

        Raises:
            ConfigError: the address cannot be bound, or the newest usable
                checkpoint contradicts the config.
        """
        size = self.settings.max_message_bytes
        interceptors = [_TokenAuth(self._token)] if self._token else []
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
            ],
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
        log.info("listening on %s:%d (event loop: %s, engine threads: %d, auth: %s)",
                 host, self.port, loop_name(), self.settings.workers,
                 "token" if self._token else "off")
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
            self._checkpoint_executor, self.checkpointer.restore, self._make_tables, cancel)
        if restored is None:
            log.info("no checkpoint to restore in %s: starting with empty tables",
                     self.checkpointer.path)
        else:
            self.tables, result = restored
            self._servicer.use_tables(self.tables)
            rows = sum(t.rows for t in result.manifest.tables)
            log.info("restored %d table(s) from %s (%d rows, %.1f MB in %.2f s)",
                     len(result.manifest.tables), result.path, rows,
                     result.manifest.nbytes / 1e6, result.seconds)
        self._restored = True
        self._servicer.calls.restoring = False

    async def _checkpoint_every(self, interval: float) -> None:
        """Timed checkpoints, ``interval`` seconds after the end of the previous one."""
        assert self.checkpointer is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                await loop.run_in_executor(self._checkpoint_executor, self.checkpointer.checkpoint,
                                           self.tables, "timer")
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
                await loop.run_in_executor(self._checkpoint_executor, self.checkpointer.checkpoint,
                                           self.tables, "shutdown")
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
