"""Admitting calls: a cap on calls in flight, and memory reserved before a request is read.

Every replay call goes through :class:`Admission` before anything of it is
read or run:

1. It is counted against ``max_concurrent_calls`` until it ends (a call whose
   response a slow reader has not taken yet is still in flight); over the
   cap it is refused with RESOURCE_EXHAUSTED (kind ``overloaded``).
2. The memory its request will take is reserved from the
   :class:`~replay_server.service.budget.MemoryBudget`: the size the client
   declared (``replay_proto.call_metadata``), else the message-size limit.
   A unary call waits up to :data:`ADMISSION_WAIT_S` (within its deadline)
   for room, then is refused (RESOURCE_EXHAUSTED, kind ``overloaded``).
   Only then is the request read, and the reservation shrinks to its real
   size. A request larger than declared is refused.
3. The reservation travels with the call: a handler grows it before it
   draws a batch, and it is released when the call ends, i.e. when gRPC has
   handed the last response byte to the socket.

A chunked request (``InsertChunks``, ``PublishChunks``) is admitted like a
unary one for its first message, then reserves the whole request before
the rest is read (:mod:`replay_server.service.chunked_request`); a
server-streaming call (``SampleChunks``, ``FetchChunks``) like a unary one.

A ``SampleStream`` reserves, for its whole life, room for one learner
message at a time: the size it declared, else
:data:`~replay_proto.call_metadata.STREAM_MESSAGE_BYTES` (the protocol's
messages are a few hundred bytes). A message over that ends the stream
(INVALID_ARGUMENT).

What the budget cannot see: gRPC reads a message before its size is known,
so a call that declares less than it sends makes the server hold one
message of up to ``max_message_mb`` (a few MiB) before it is refused. That
is bounded by the transport, not by the client's word: at most
``max_concurrent_calls`` such messages (plus each stream's 64 KiB
flow-control window; see docs/service.md, "Limits").

That is why the unary RPCs are served by *stream*-unary handlers: gRPC reads
a unary handler's request before the handler runs, while a stream handler
reads it when asked (the bytes on the wire are the same). A refused call's
request is never read: it costs a few kilobytes of HTTP/2 window at most.

Thread-safety: event-loop only (reservations themselves are thread-safe).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, declared_request_bytes
from replay_proto.codec import CodecError
from replay_server.service.budget import MemoryBudget, Reservation
from replay_server.service.chunked_request import read_chunked
from replay_server.service.limits import ServiceLimits
from replay_server.service.status import LimitExceededError, OverloadedError, abort

ADMISSION_WAIT_S = 1.0
"""How long a unary call may wait for room in the budget to read its request."""

UnaryBehaviour = Callable[[bytes, grpc.aio.ServicerContext, Reservation], Awaitable[bytes]]
StreamBehaviour = Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext, Reservation],
                           AsyncIterator[bytes]]


class Admission:
    """Admits the service's calls (see the module docstring).

    Args:
        limits: the service's limits.
        budget: the memory budget calls reserve from.

    Attributes:
        in_flight: replay calls admitted and not yet ended.
        refused: calls refused for the cap on calls in flight.
    """

    def __init__(self, limits: ServiceLimits, budget: MemoryBudget) -> None:
        self.limits = limits
        self.budget = budget
        self.in_flight = 0
        self.refused = 0

    def unary(self, name: str, behaviour: UnaryBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving unary RPC ``name`` with ``behaviour(raw, context, reservation)``."""

        async def handle(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            raw, reservation = await self._request(name, context)
            return await behaviour(raw, context, reservation)

        return grpc.stream_unary_rpc_method_handler(handle)

    def chunked(self, name: str, message_type: type,
                behaviour: UnaryBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving client-streaming RPC ``name``: a chunked transfer of
        ``message_type`` (:mod:`replay_proto.chunks`), rebuilt in memory reserved from the
        budget, then served by ``behaviour`` exactly as the unary form would be."""

        async def handle(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            raw, reservation = await self._request(name, context, keep=True)
            message = await read_chunked(raw, message_type, context, reservation,
                                         self._grow, name)
            return await behaviour(message, context, reservation)

        return grpc.stream_unary_rpc_method_handler(handle)

    def unary_stream(self, name: str, behaviour: StreamBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving server-streaming RPC ``name`` with
        ``behaviour(raw, context, reservation)``, an async iterator of answers."""

        async def handle(_requests: AsyncIterator[bytes],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            raw, reservation = await self._request(name, context)
            async for message in behaviour(raw, context, reservation):
                yield message

        return grpc.stream_stream_rpc_method_handler(handle)

    async def _request(self, name: str, context: grpc.aio.ServicerContext,
                       keep: bool = False) -> tuple[bytes, Reservation]:
        """Admit the call and read its (first) request message; the reservation then holds
        exactly that message, or (``keep``) still what the call declared."""
        reservation = await self._admit(name, context, self.limits.max_message_bytes, wait=True)
        # context.read(), not the request iterator: the iterator's suspended frame
        # would keep the message alive after the call (7 MB for an Atari insert), so
        # each call's bytes landed in fresh pages (measured: 2.4x the page faults).
        raw = await context.read()
        if raw is grpc.aio.EOF:
            await abort(context, CodecError(f"{name}: the call carried no request"))
        await self._check_size(name, raw, reservation, context)
        if not keep and len(raw) != reservation.nbytes:
            reservation.resize(len(raw), "")  # read: it holds exactly its request now
        return raw, reservation

    async def _grow(self, reservation: Reservation, nbytes: int, purpose: str,
                    context: grpc.aio.ServicerContext) -> None:
        """Grow ``reservation`` to ``nbytes``, waiting up to ADMISSION_WAIT_S (within the
        deadline) for room, or end the call with RESOURCE_EXHAUSTED."""
        try:
            reservation.resize(nbytes, purpose)
            return
        except OverloadedError as exc:
            refusal = exc
        except LimitExceededError as exc:
            await abort(context, exc)
        remaining = context.time_remaining()
        timeout = ADMISSION_WAIT_S if remaining is None else min(ADMISSION_WAIT_S, remaining)
        try:
            await asyncio.wait_for(self.budget.wait(nbytes, purpose, reservation),
                                   max(0.0, timeout))
        except TimeoutError:
            await abort(context, refusal)

    def stream(self, name: str, behaviour: StreamBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving bidirectional RPC ``name`` with ``behaviour(requests, context, reservation)``.

        The reservation covers one client message at a time (the declared
        size); the behaviour checks each message against it and reserves
        what it draws.
        """

        async def handle(requests: AsyncIterator[bytes],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            reservation = await self._admit(name, context, STREAM_MESSAGE_BYTES, wait=False)
            async for message in behaviour(requests, context, reservation):
                yield message

        return grpc.stream_stream_rpc_method_handler(handle)

    async def _admit(self, name: str, context: grpc.aio.ServicerContext, default: int,
                     wait: bool) -> Reservation:
        """Count the call and reserve its request's memory (what it declared, else
        ``default``; waiting for room if ``wait``), or end it with RESOURCE_EXHAUSTED."""
        if self.in_flight >= self.limits.max_concurrent_calls:
            self.refused += 1
            await abort(context, OverloadedError(
                f"{name}: the server is serving server.max_concurrent_calls = "
                f"{self.limits.max_concurrent_calls} calls already; the call was not run: try "
                f"again later"))
        self.in_flight += 1
        ended = _Ended(self)
        context.add_done_callback(ended)
        declared = declared_request_bytes(context.invocation_metadata(), default,
                                          self.limits.max_message_bytes)
        purpose = f"{name}: its request"
        try:
            reservation = self.budget.reserve(declared, purpose)
        except OverloadedError as exc:
            if not wait:
                await abort(context, exc)
            reservation = await self._wait(declared, purpose, context, exc)
        except LimitExceededError as exc:
            await abort(context, exc)
        ended.reservation = reservation
        return reservation

    async def _wait(self, nbytes: int, purpose: str, context: grpc.aio.ServicerContext,
                    refusal: OverloadedError) -> Reservation:
        """Wait up to ADMISSION_WAIT_S (within the deadline) for room, or end the call."""
        remaining = context.time_remaining()
        timeout = ADMISSION_WAIT_S if remaining is None else min(ADMISSION_WAIT_S, remaining)
        try:
            return await asyncio.wait_for(self.budget.wait(nbytes, purpose), max(0.0, timeout))
        except TimeoutError:
            await abort(context, refusal)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    async def _check_size(self, name: str, raw: bytes, reservation: Reservation,
                          context: grpc.aio.ServicerContext) -> None:
        if len(raw) > reservation.nbytes:
            await abort(context, CodecError(
                f"{name}: the request has {len(raw)} bytes but the call declared "
                f"{reservation.nbytes} (metadata replay-request-bytes)"))

    def describe(self) -> dict[str, int]:
        return {"calls_in_flight": self.in_flight, "calls_refused": self.refused}


class _Ended:
    """A call's done-callback: it is no longer in flight, and its memory is free."""

    __slots__ = ("_admission", "reservation")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.reservation: Reservation | None = None

    def __call__(self, _context: object) -> None:
        self._admission.in_flight -= 1
        if self.reservation is not None:
            self.reservation.release()
