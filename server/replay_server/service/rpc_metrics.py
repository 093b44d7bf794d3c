"""Per-RPC metrics: every call counted and timed by its gRPC method and status code.

:class:`RpcMetrics` is a server interceptor that wraps whatever handler
serves a call (the replay service's, the health service's, the token check's
refusal), so any method is covered by its gRPC name without knowing it in
advance; methods the server does not serve are not counted (their names are
the caller's to choose, so they would make the label set unbounded). Names
follow the go-grpc-prometheus convention, which existing dashboards know:

    grpc_server_started_total{grpc_service, grpc_method, grpc_type}
    grpc_server_handled_total{..., grpc_code}        calls finished, by status code
    grpc_server_handling_seconds{..., grpc_code}     histogram of call durations
    grpc_server_msg_received_total / _msg_sent_total messages (streams: each one)
    replay_rpc_received_bytes_total / _sent_bytes_total{grpc_service, grpc_method}
    replay_rpc_open_streams{grpc_service, grpc_method}  streaming calls open now

A stream's duration is its whole life. Messages a handler writes through
``context.write`` (the health service's ``Watch``) are not seen, only the
call. Bytes are the serialized messages (what handlers receive and return:
raw bytes for ``replay.v1.ReplayService``), not HTTP/2 framing or TLS.

Cost: a few microseconds per call and per stream message, on the event loop;
the labelled children are looked up once per method and code.
Thread-safety: updated on the event loop; prometheus_client's values lock
themselves, so scrapes from the HTTP thread read them safely.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, float("inf"))
"""Call durations, in seconds: from a 100 us insert to a learner's stream of minutes."""

_TYPES = {(False, False): "unary", (False, True): "server_stream",
          (True, False): "client_stream", (True, True): "bidi_stream"}


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts, times and sizes every call (see the module docstring).

    Args:
        registry: where the metrics are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        method = ("grpc_service", "grpc_method", "grpc_type")
        self._started = Counter("grpc_server_started", "RPCs started on the server.",
                                method, registry=registry)
        self._handled = Counter("grpc_server_handled", "RPCs finished, by status code.",
                                (*method, "grpc_code"), registry=registry)
        self._seconds = Histogram("grpc_server_handling_seconds",
                                  "RPC duration until the status is sent (streams: their life).",
                                  (*method, "grpc_code"), buckets=LATENCY_BUCKETS,
                                  registry=registry)
        self._received = Counter("grpc_server_msg_received", "Messages received.", method,
                                 registry=registry)
        self._sent = Counter("grpc_server_msg_sent", "Messages sent.", method, registry=registry)
        self._bytes_in = Counter("replay_rpc_received_bytes",
                                 "Bytes of the messages received (serialized).",
                                 ("grpc_service", "grpc_method"), registry=registry)
        self._bytes_out = Counter("replay_rpc_sent_bytes",
                                  "Bytes of the messages sent (serialized).",
                                  ("grpc_service", "grpc_method"), registry=registry)
        self._open = Gauge("replay_rpc_open_streams", "Streaming RPCs open now.",
                           ("grpc_service", "grpc_method"), registry=registry)
        self._methods: dict[str, _Method] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        kind = _TYPES[(bool(handler.request_streaming), bool(handler.response_streaming))]
        key = f"{details.method} {kind}"
        method = self._methods.get(key)
        if method is None:
            method = self._methods[key] = _Method(self, details.method, kind)
        return method.wrap(handler)

    def handled(self, labels: tuple[str, str, str], code: str) -> tuple[Any, Any]:
        """The ``(handled counter, duration histogram)`` children of one method and code."""
        return self._handled.labels(*labels, code), self._seconds.labels(*labels, code)


class _Method:
    """One served method's labelled metrics, and the wrappers that feed them."""

    def __init__(self, metrics: RpcMetrics, path: str, kind: str) -> None:
        service, _, name = path.lstrip("/").rpartition("/")
        labels = (service, name, kind)
        self._metrics = metrics
        self._labels = labels
        self._started = metrics._started.labels(*labels)
        self._received = metrics._received.labels(*labels)
        self._sent = metrics._sent.labels(*labels)
        self._bytes_in = metrics._bytes_in.labels(service, name)
        self._bytes_out = metrics._bytes_out.labels(service, name)
        self._open = metrics._open.labels(service, name) if kind != "unary" else None
        self._by_code: dict[str, tuple[Any, Any]] = {}

    def wrap(self, handler: Any) -> Any:
        options = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), **options)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, request_streaming=False), **options)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary),
                                                        **options)
        return grpc.stream_stream_rpc_method_handler(
            self._streaming(handler.stream_stream, request_streaming=True), **options)

    def _unary(self, behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        streaming = self._open is not None  # stream_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = self._begin()
            if streaming:
                request = self._count_requests(request)
            else:
                self._message_in(request)
            code = "UNKNOWN"
            try:
                response = await behaviour(request, context)
                self._message_out(response)
                code = "OK"
                return response
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            finally:
                self._end(context, code, started)

        return call

    def _streaming(self, behaviour: Callable[..., Any], *, request_streaming: bool
                   ) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = self._begin()
            if request_streaming:
                request = self._count_requests(request)
            else:
                self._message_in(request)
            code = "UNKNOWN"
            try:
                result = behaviour(request, context)
                if hasattr(result, "__aiter__"):
                    try:
                        async for message in result:
                            self._message_out(message)
                            yield message
                    finally:  # closed now, not whenever the collector finds it
                        await result.aclose()
                else:  # a coroutine that writes through context.write (health's Watch)
                    await result
                code = "OK"
            except (asyncio.CancelledError, GeneratorExit):  # the client went away
                code = "CANCELLED"
                raise
            finally:
                self._end(context, code, started)

        return call

    async def _count_requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            self._message_in(message)
            yield message

    def _begin(self) -> float:
        self._started.inc()
        if self._open is not None:
            self._open.inc()
        return time.perf_counter()

    def _end(self, context: grpc.aio.ServicerContext, code: str, started: float) -> None:
        seconds = time.perf_counter() - started
        status = context.code()
        if status is not None:  # set by abort (or set_code): it wins over how the handler ended
            code = status.name
        children = self._by_code.get(code)
        if children is None:
            children = self._by_code[code] = self._metrics.handled(self._labels, code)
        handled, histogram = children
        handled.inc()
        histogram.observe(seconds)
        if self._open is not None:
            self._open.dec()

    def _message_in(self, message: Any) -> None:
        self._received.inc()
        self._bytes_in.inc(_size(message))

    def _message_out(self, message: Any) -> None:
        self._sent.inc()
        self._bytes_out.inc(_size(message))


def _size(message: Any) -> int:
    if isinstance(message, (bytes, bytearray)):
        return len(message)
    byte_size = getattr(message, "ByteSize", None)
    return byte_size() if byte_size is not None else 0
