"""The server process: tables, the gRPC server, health, auth and shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from replay_server.errors import ConfigError
from replay_server.service.loop import loop_name
from replay_server.service.servicer import SERVICE_NAME, ReplayServicer
from replay_server.settings import ServerSettings
from replay_server.tables import Tables

log = logging.getLogger("replay_server")

HEALTH_SERVICE = "grpc.health.v1.Health"


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (health checks excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong token: send metadata 'authorization: Bearer <token>'",
                trailing_metadata=(("replay-error-kind", "unauthenticated"),),
            )
            return b""

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)
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
    ``replay.v1.ReplayService``) is SERVING once the tables are ready and
    NOT_SERVING while draining.

    Args:
        settings: validated server settings.

    Raises:
        ConfigError: the auth token variable is unset, or a table config is invalid.
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        pinned = settings.pinned
        self.tables = Tables(replace(t, pin_memory=pinned) for t in settings.tables)
        self._token = None
        if settings.auth_token_env is not None:
            self._token = os.environ.get(settings.auth_token_env)
            if not self._token:
                raise ConfigError(
                    f"server.auth_token_env is {settings.auth_token_env!r} but that environment "
                    f"variable is unset or empty"
                )
        self._executor = ThreadPoolExecutor(settings.workers, thread_name_prefix="replay-engine")
        self._servicer = ReplayServicer(self.tables, self._executor, settings.max_message_bytes,
                                        settings.shared_memory)
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind, start serving and report SERVING; returns the bound port."""
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
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        host = self.settings.address.rsplit(":", 1)[0]
        log.info("listening on %s:%d (event loop: %s, engine threads: %d, auth: %s)",
                 host, self.port, loop_name(), self.settings.workers,
                 "token" if self._token else "off")
        return self.port

    async def stop(self, grace: float = 10.0) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace``."""
        if self._server is None:
            return
        self._servicer.draining = True
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(grace)
        self._executor.shutdown(wait=True)
        self._server = None
        log.info("stopped")

    async def serve(self, *, port_file: Path | None = None, grace: float = 10.0) -> None:
        """Start, then run until SIGTERM or SIGINT; a second signal exits at once."""
        port = await self.start()
        if port_file is not None:
            port_file.write_text(f"{port}\n")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                os._exit(1)
            log.info("%s received: draining (grace %.0f s)", signal.Signals(signum).name, grace)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        await stop.wait()
        await self.stop(grace)
