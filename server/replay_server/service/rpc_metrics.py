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

A stream's duration is its whole life. A call that travels as a message of a
call stream (an insert or a priority update on ``CallStream``) is counted as
the unary call it stands for as well (:meth:`RpcMetrics.carried`). Messages a
handler reads with ``context.read()`` or writes with ``context.write()`` are
counted like those it takes from its iterator or yields (the replay service
serves its unary methods as streams that write their one answer, so that an
answer nobody reads can be given up: :mod:`~replay_server.service.admission`);
they keep their declared type in the labels. Bytes are the serialized messages (what handlers receive and return:
raw bytes for ``replay.v1.ReplayService``), not HTTP/2 framing or TLS.

Cost: about a microsecond or two per call and per stream message, on the
event loop: the figures are plain integers in one object per method (and
per status code), the histogram one bucket index found by bisection; the
wrapped handler is made once per method. Thread-safety: written only on the
event loop; :meth:`RpcMetrics.collect` (a scrape, on the HTTP server's
thread) copies them without a lock, so a scrape never holds up a call.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds of the call-duration buckets, in seconds (then +Inf): from a 100 us
insert to a learner's stream of minutes."""

_TYPES = {(False, False): "unary", (False, True): "server_stream",
          (True, False): "client_stream", (True, True): "bidi_stream"}


class _Outcome:
    """Calls of one method that ended with one status code: count and durations."""

    __slots__ = ("handled", "buckets", "seconds")

    def __init__(self) -> None:
        self.handled = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: +Inf
        self.seconds = 0.0


class _Method:
    """One served method's figures, and the wrappers that keep them."""

    __slots__ = ("labels", "streaming", "declared_streaming", "started", "received", "sent",
                 "bytes_in", "bytes_out", "open", "outcomes", "_wrapped")

    def __init__(self, path: str, kind: str) -> None:
        service, _, name = path.lstrip("/").rpartition("/")
        self.labels = (service, name, _declared_kind(service, name) or kind)
        self.streaming = kind != "unary"  # how the handler is served (may differ: see below)
        self.declared_streaming = self.labels[2] != "unary"
        self.started = self.received = self.sent = self.bytes_in = self.bytes_out = 0
        self.open = 0
        self.outcomes: dict[str, _Outcome] = {}
        # handler -> its wrapper, by identity: the service's own, the token check's refusal
        self._wrapped: dict[int, tuple[Any, Any]] = {}

    def wrap(self, handler: Any) -> Any:
        """``handler`` with its behaviour wrapped (made once per handler, then reused)."""
        known = self._wrapped.get(id(handler))
        if known is not None and known[0] is handler:
            return known[1]
        options = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary),
                                                          **options)
        elif handler.unary_stream is not None:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, request_streaming=False), **options)
        elif handler.stream_unary is not None:
            wrapped = grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary),
                                                           **options)
        else:
            wrapped = grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.stream_stream, request_streaming=True), **options)
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

    def _unary(self, behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        streaming = self.streaming  # stream_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = self._begin()
            request = self._received(request, streaming)
            code = "UNKNOWN"
            try:
                # A stream-unary handler may read with context.read() (admission does):
                # what it reads that way is counted too.
                response = await behaviour(request, _CountedReads(context, self)
                                           if streaming else context)
                self.sent += 1
                self.bytes_out += _size(response)
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
            request = self._received(request, request_streaming)
            code = "UNKNOWN"
            try:
                result = behaviour(request, _CountedReads(context, self))
                if hasattr(result, "__aiter__"):
                    try:
                        async for message in result:
                            self.sent += 1
                            self.bytes_out += _size(message)
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

    def _received(self, request: Any, streaming: bool) -> Any:
        """The handler's request, counted: one message now, or each as a stream yields it."""
        if streaming:
            return self._count_requests(request)
        self.received += 1
        self.bytes_in += _size(request)
        return request

    async def _count_requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in requests:
            self.received += 1
            self.bytes_in += _size(message)
            yield message

    def _begin(self) -> float:
        self.started += 1
        if self.declared_streaming:
            self.open += 1
        return time.perf_counter()

    def _end(self, context: grpc.aio.ServicerContext, code: str, started: float) -> None:
        seconds = time.perf_counter() - started
        status = context.code()
        if status is not None:  # set by abort (or set_code): it wins over how the handler ended
            code = status.name
        self.handled(code, seconds)
        if self.declared_streaming:
            self.open -= 1

    def handled(self, code: str, seconds: float) -> None:
        """One call of this method ended with ``code`` after ``seconds``."""
        outcome = self.outcomes.get(code)
        if outcome is None:
            outcome = self.outcomes[code] = _Outcome()
        outcome.handled += 1
        outcome.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        outcome.seconds += seconds


class _CountedReads:
    """A call's context whose ``read()`` and ``write()`` count each message.

    The messages a handler takes from its request iterator are counted by
    :meth:`_Method._count_requests`; those it reads with ``context.read()``
    (gRPC's iterator reads from the real context, so nothing is counted twice)
    are counted here, and so are those it writes with ``context.write()``.
    Everything else is the call's own context.
    """

    __slots__ = ("_context", "_method")

    def __init__(self, context: grpc.aio.ServicerContext, method: _Method) -> None:
        self._context = context
        self._method = method

    async def read(self) -> Any:
        message = await self._context.read()
        if message is not grpc.aio.EOF:
            self._method.received += 1
            self._method.bytes_in += _size(message)
        return message

    async def write(self, message: Any) -> None:
        await self._context.write(message)
        self._method.sent += 1
        self._method.bytes_out += _size(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class RpcMetrics(grpc.aio.ServerInterceptor, Collector):
    """Counts, times and sizes every call (see the module docstring).

    Install it as the server's first interceptor, and register it in the
    server's metrics registry (it is the collector of its own figures).
    """

    def __init__(self) -> None:
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
            method = self._methods[key] = _Method(details.method, kind)
        return method.wrap(handler)

    def carried(self, path: str, code: str, seconds: float, received: int,
                sent: int | None) -> None:
        """Count a call that travelled as a message of a call stream
        (:mod:`~replay_server.service.call_stream`) as the unary call ``path``
        (``/service/Method``) it stands for: started, ended with ``code`` after ``seconds``,
        one message of ``received`` bytes in and, unless ``sent`` is ``None`` (it failed), one
        of ``sent`` bytes out.
        So dashboards of inserts and updates see every one, on a stream or not (the stream's
        own messages are counted under its name as well). Event loop only."""
        key = f"{path} bidi_stream"  # how the replay service serves its unary methods
        method = self._methods.get(key)
        if method is None:
            method = self._methods[key] = _Method(path, "bidi_stream")
        method.started += 1
        method.received += 1
        method.bytes_in += received
        if sent is not None:
            method.sent += 1
            method.bytes_out += sent
        method.handled(code, seconds)

    def collect(self) -> Iterator[Metric]:
        labels = ["grpc_service", "grpc_method", "grpc_type"]
        started = CounterMetricFamily("grpc_server_started", "RPCs started on the server.",
                                      labels=labels)
        handled = CounterMetricFamily("grpc_server_handled", "RPCs finished, by status code.",
                                      labels=[*labels, "grpc_code"])
        seconds = HistogramMetricFamily(
            "grpc_server_handling_seconds",
            "RPC duration until the status is sent (streams: their life).",
            labels=[*labels, "grpc_code"])
        received = CounterMetricFamily("grpc_server_msg_received", "Messages received.",
                                       labels=labels)
        sent = CounterMetricFamily("grpc_server_msg_sent", "Messages sent.", labels=labels)
        bytes_in = CounterMetricFamily("replay_rpc_received_bytes",
                                       "Bytes of the messages received (serialized).",
                                       labels=labels[:2])
        bytes_out = CounterMetricFamily("replay_rpc_sent_bytes",
                                        "Bytes of the messages sent (serialized).",
                                        labels=labels[:2])
        open_streams = GaugeMetricFamily("replay_rpc_open_streams", "Streaming RPCs open now.",
                                         labels=labels[:2])
        bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
        for method in dict(self._methods).values():  # a copy: the event loop may add one
            values = list(method.labels)
            started.add_metric(values, method.started)
            received.add_metric(values, method.received)
            sent.add_metric(values, method.sent)
            bytes_in.add_metric(values[:2], method.bytes_in)
            bytes_out.add_metric(values[:2], method.bytes_out)
            if method.declared_streaming:
                open_streams.add_metric(values[:2], method.open)
            for code, outcome in dict(method.outcomes).items():
                handled.add_metric([*values, code], outcome.handled)
                cumulative, total = [], 0
                for bound, count in zip(bounds, list(outcome.buckets)):
                    total += count
                    cumulative.append((bound, total))
                seconds.add_metric([*values, code], cumulative, outcome.seconds)
        yield from (started, handled, seconds, received, sent, bytes_in, bytes_out, open_streams)


def _declared_kind(service: str, method: str) -> str | None:
    """The RPC's type as its .proto declares it, when the descriptor is loaded.

    The replay service serves its unary RPCs with stream-unary handlers (so
    that admission can refuse a call before its request is read: see
    :mod:`replay_server.service.admission`); the ``grpc_type`` label still
    says what the API is.
    """
    try:
        found = descriptor_pool.Default().FindServiceByName(service).methods_by_name[method]
    except KeyError:
        return None
    return _TYPES[(found.client_streaming, found.server_streaming)]


def _size(message: Any) -> int:
    if isinstance(message, (bytes, bytearray)):
        return len(message)
    byte_size = getattr(message, "ByteSize", None)
    return byte_size() if byte_size is not None else 0
