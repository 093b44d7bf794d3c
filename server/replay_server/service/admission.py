"""Admitting calls: caps on calls working and waiting, and memory reserved before a request is read.

Every replay call goes through :class:`Admission` before anything of it is
read or run:

1. It is counted against ``max_concurrent_calls`` until its handler has
   written its last answer (a call whose response a slow reader has not
   taken yet is still in flight: the write waits for HTTP/2 flow control);
   over the cap it is refused with RESOURCE_EXHAUSTED (kind ``overloaded``).
   The slot is given back before the call's status goes out (it was freed by
   gRPC's end-of-call callback, after it: a client making one call at a time
   was refused "8 calls already" for its own last call).
   **Waiting calls have a pool of their own**, ``max_waiting_calls``: a
   stream (``SampleStream``, ``CallStream``: long-lived, idle between
   messages) is counted there from the start, and a unary call moves there
   when it starts to wait (:meth:`Admission.start_waiting`: a fetch for a
   newer version, a sample or insert its rate limiter holds, a sample
   waiting for data), leaving its working slot. So 256 waiters once took
   every slot the inserts, publishes and info calls that would release them
   needed; now they fill their own pool, past which a call that would wait
   is refused (RESOURCE_EXHAUSTED, ``overloaded``: it ran nothing). Streams
   are also capped by ``max_streams`` within that pool: a stream reads
   messages all its life (gRPC may hold a whole one for it), a waiting unary
   call has read its request already, so streams are what the memory bound
   counts, and the pool can hold many cheap waiters. **One source address may
   hold only its share of each pool** (``max_host_share``:
   :mod:`~replay_server.service.host_shares`), so a flood from one place (calls
   whose answers nobody reads, streams that idle) leaves room for everyone else;
   a call past its address's share is refused like one past a cap.
2. The memory its request will take is reserved from the
   :class:`~replay_server.service.budget.MemoryBudget`: the size the client
   declared (``replay_proto.call_metadata``), else the message-size limit.
   A unary call waits up to ``server.memory_wait_s`` (within its deadline)
   for room, then is refused (RESOURCE_EXHAUSTED, kind ``overloaded``).
   Only then is the request read, and the reservation shrinks to its real
   size. A request larger than declared is refused.
3. The reservation travels with the call: a handler grows it before it
   draws a batch, and it is released when the call ends, i.e. when gRPC has
   handed the last response byte to the socket.
4. **An answer nobody reads is given up.** A client that stops reading
   leaves its answer in gRPC's buffers (HTTP/2 flow control): a unary call
   is therefore served as a stream that writes its one answer, which must
   be taken within ``response_timeout_s``; else the call is cancelled
   (the stream reset: no status can follow a message gRPC still holds), and
   its memory and slot are free again. (720 MiB of
   unread answers once stayed reserved for good, refusing every sample.)
   The client sees an ordinary unary call.

**A call that does not speak in time loses its slot.** Every call's first
message (a unary call's request, a stream's opening message) must arrive
within ``request_timeout_s`` of the call's admission, and each next message
of a chunked request within ``request_timeout_s`` of the previous one, at
a pace of one message per ``request_timeout_s`` on average
(:mod:`replay_server.service.chunked_request`); else
the call is ended (DEADLINE_EXCEEDED, :class:`~replay_server.service.status.RequestTimeoutError`)
and its slot and reserved memory are free again. (256 unary calls that
never sent their request held every working slot for minutes; 128 silent
streams every stream slot; one stalled chunked upload 760 of 768 MiB of
the budget.)

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

That is why the unary RPCs are served by *stream* handlers: gRPC reads a
unary handler's request before the handler runs, while a stream handler
reads it when asked, and writes its answer when told, so the handler can
time the write (the bytes on the wire are the same). A refused call's
request is never read: it costs a few kilobytes of HTTP/2 window at most.

Admission also tells the control-frame meter
(:mod:`~replay_server.service.control_meter`) what each connection's calls
account for: each call admitted, the bytes it declared while they are on their
way, each message read, and each call refused before its request was read.

Thread-safety: event-loop only (reservations themselves are thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, declared_request_bytes
from replay_proto.codec import CodecError
from replay_server.service.budget import MemoryBudget, Reservation
from replay_server.service.chunked_request import read_chunked
from replay_server.service.host_shares import STREAMS, WAITING, WORKING, HostShares
from replay_server.service.limits import ServiceLimits
from replay_server.service.peer_log import peer_host
from replay_server.service.status import (
    CLIENT_LOG,
    LimitExceededError,
    OverloadedError,
    RequestTimeoutError,
    abort,
)

T = TypeVar("T")

UnaryBehaviour = Callable[[bytes, grpc.aio.ServicerContext, Reservation], Awaitable[bytes]]
"""``behaviour(raw request, context, reservation) -> raw answer``."""
ChunkedBehaviour = Callable[[Any, grpc.aio.ServicerContext, Reservation], Awaitable[bytes]]
"""As :data:`UnaryBehaviour`, given the whole request as bytes or a view of them."""
StreamBehaviour = Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext, Reservation],
                           AsyncIterator[bytes]]
"""``behaviour(requests, context, reservation)``: the answers of a bidirectional stream."""
AnswersBehaviour = Callable[[bytes, grpc.aio.ServicerContext, Reservation], AsyncIterator[bytes]]
"""``behaviour(raw request, context, reservation)``: the answers of a server stream."""


class Admission:
    """Admits the service's calls (see the module docstring).

    Args:
        limits: the service's limits.
        budget: the memory budget calls reserve from.

    Attributes:
        in_flight: replay calls admitted, working (not waiting) and not yet ended.
        waiting: calls in the waiting pool (streams, and calls that waited).
        streams: streams open (counted in ``waiting`` too).
        refused: calls refused for the caps on calls working or waiting, or for their
            address's share of them.
        shares: what each source address holds of the pools, and its share.
        unread: unary calls ended because their client did not take the answer.
        silent: calls ended because a message they owed did not come within
            ``request_timeout_s`` (a first message, a chunked request's next one).
    """

    def __init__(self, limits: ServiceLimits, budget: MemoryBudget) -> None:
        self.limits = limits
        self.budget = budget
        self.in_flight = 0
        self.waiting = 0
        self.streams = 0
        self.refused = 0
        self.shares = HostShares(limits.max_host_share, (
            limits.max_concurrent_calls, limits.max_waiting_calls, limits.max_streams))
        self.unread = 0
        self.silent = 0
        self._tickets: dict[int, _Ended] = {}  # id(context) -> its call, while it lasts
        self.on_call: Callable[[str], None] | None = None
        """Told the peer of every call admitted (the connection guard keeps its connection)."""
        self.on_silent_end: Callable[[str], None] | None = None
        """Told the peer of every call that ended before its first message arrived (a reset:
        :mod:`~replay_server.service.reset_meter`)."""
        self.on_message: Callable[[str, int], None] | None = None
        """Told the peer and size of every request message read (the control-frame meter
        allows a connection that much: :mod:`~replay_server.service.control_meter`)."""
        self.on_expect: Callable[[str, int], None] | None = None
        """Told the peer of a call and the request bytes it declared when it is admitted (to
        come), and their negative once it was read whole or ended (the control-frame meter
        allows bytes on their way)."""
        self.on_unread: Callable[[str, int], None] | None = None
        """Told the peer of every call refused, or ended after it spoke, before its request
        was read, and the bytes it had declared (0: none yet): what its client sent of it
        was never read (the control-frame meter allows it)."""

    def unary(self, name: str, behaviour: UnaryBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving unary RPC ``name`` with ``behaviour(raw, context, reservation)``."""

        async def handle(_requests: AsyncIterator[bytes],
                         context: grpc.aio.ServicerContext) -> None:
            try:
                raw, reservation = await self._request(name, context)
                answer = await behaviour(raw, context, reservation)
                await self._answer(name, answer, context)
            finally:
                self._leave(context)

        return grpc.stream_stream_rpc_method_handler(handle)

    async def _answer(self, name: str, answer: bytes, context: grpc.aio.ServicerContext) -> None:
        """Write an answer message (a unary call's one, or each of a chunked answer); one not
        taken in ``response_timeout_s`` ends the call."""
        timeout = self.limits.response_timeout_s
        task = asyncio.current_task()
        assert task is not None
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        # A timer, not asyncio.wait_for: no extra task per call (microseconds on every call).
        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            await context.write(answer)
        except asyncio.CancelledError:
            if expired:  # no status can follow a message gRPC still holds: the call is
                self.unread += 1  # cancelled (RST_STREAM), which frees it
                CLIENT_LOG.log(_peer(context), "unread", logging.INFO,
                               "%s: dropped an answer of %d bytes its client at %s did not "
                               "take within server.response_timeout_s = %g s", name,
                               len(answer), _peer(context), timeout)
            raise
        finally:
            timer.cancel()

    def chunked(self, name: str, message_type: type,
                behaviour: ChunkedBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving client-streaming RPC ``name``: a chunked transfer of
        ``message_type`` (:mod:`replay_proto.chunks`), rebuilt in memory reserved from the
        budget, then served by ``behaviour`` exactly as the unary form would be."""

        async def handle(_requests: AsyncIterator[bytes],
                         context: grpc.aio.ServicerContext) -> None:
            async def read_next(seconds: float, why: str) -> bytes:
                message = await self.in_time(context, context.read, seconds, why)
                self._heard(context, message)
                return message

            try:
                raw, reservation = await self._request(name, context, keep=True)
                message = await read_chunked(raw, message_type, context, reservation,
                                             self._grow, name, read_next,
                                             self.limits.request_timeout_s)
                self._read(context)
                answer = await behaviour(message, context, reservation)
                await self._answer(name, answer, context)
            finally:
                self._leave(context)

        return grpc.stream_stream_rpc_method_handler(handle)

    def unary_stream(self, name: str, behaviour: AnswersBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving server-streaming RPC ``name`` with
        ``behaviour(raw, context, reservation)``, an async iterator of answers."""

        async def handle(_requests: AsyncIterator[bytes],
                         context: grpc.aio.ServicerContext) -> None:
            try:
                raw, reservation = await self._request(name, context)
                async for message in behaviour(raw, context, reservation):
                    await self._answer(name, message, context)  # each taken in time
            finally:
                self._leave(context)

        return grpc.stream_stream_rpc_method_handler(handle)

    async def _request(self, name: str, context: grpc.aio.ServicerContext,
                       keep: bool = False) -> tuple[bytes, Reservation]:
        """Admit the call and read its (first) request message; the reservation then holds
        exactly that message, or (``keep``) still what the call declared."""
        reservation = await self._admit(name, context, self.limits.max_message_bytes, wait=True)
        # context.read(), not the request iterator: the iterator's suspended frame
        # would keep the message alive after the call (7 MB for an Atari insert), so
        # each call's bytes landed in fresh pages (measured: 2.4x the page faults).
        try:
            raw = await self.in_time(context, context.read, self.limits.request_timeout_s,
                                     self._silent(f"{name}: the request"))
        except MemoryError as exc:  # gRPC could not hold the request (RLIMIT_AS, say)
            await abort(context, exc)
        if raw is grpc.aio.EOF:
            await abort(context, CodecError(f"{name}: the call carried no request"))
        self._spoke(context)
        self._heard(context, raw)
        await self._check_size(name, raw, reservation, context)
        if not keep:
            self._read(context)
            if len(raw) != reservation.nbytes:
                reservation.resize(len(raw), "")  # read: it holds exactly its request now
        return raw, reservation

    def _silent(self, what: str) -> str:
        return (f"{what} did not arrive within server.request_timeout_s = "
                f"{self.limits.request_timeout_s:g} s of the call's start")

    async def in_time(self, context: grpc.aio.ServicerContext, read: Callable[[], Awaitable[T]],
                      seconds: float, why: str) -> T:
        """``await read()``, or (nothing within ``seconds``) end the call with
        :class:`RequestTimeoutError` saying ``why``; a timer, not a task (microseconds a
        call)."""
        try:
            async with asyncio.timeout(seconds):
                return await read()
        except TimeoutError:
            self.silent += 1
            self._spoke(context)  # the server ends it (request_timeout_s): no reset
            self._read(context)  # ... and what it did not send is no allowance
            CLIENT_LOG.log(_peer(context), "silent", logging.INFO, "%s (from %s): the call was "
                           "ended", why, _peer(context))
            await abort(context, RequestTimeoutError(
                f"{why}; the call was ended and its slot and memory freed (nothing of it was "
                f"run)"))
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    async def _grow(self, reservation: Reservation, nbytes: int, purpose: str,
                    context: grpc.aio.ServicerContext) -> None:
        """Grow ``reservation`` to ``nbytes``, waiting up to ``memory_wait_s`` (within the
        deadline) for room, or end the call with RESOURCE_EXHAUSTED.

        A call that must wait gives back what it holds meanwhile (its first message, read
        already: one message, which the transport bounds, for ``memory_wait_s`` at most). Else
        calls holding a message each while they wait to grow could fill the share of large
        calls between them, so that none could ever grow (measured: 16 chunked inserts of
        20 MiB from one address against 48 MiB stored 30 in a minute, the rest refused
        after their second of waiting, another address's inserts too)."""
        try:
            reservation.resize(nbytes, purpose)
            return
        except OverloadedError as exc:
            refusal = exc
        except LimitExceededError as exc:
            await abort(context, exc)
        reservation.resize(0, purpose)  # no holding while waiting (see above)
        await self._grow_within(reservation, nbytes, purpose, context, refusal)

    def stream(self, name: str, behaviour: StreamBehaviour) -> grpc.RpcMethodHandler:
        """A handler serving bidirectional RPC ``name`` with ``behaviour(requests, context, reservation)``.

        The reservation covers one client message at a time (the declared
        size); the behaviour checks each message against it and reserves
        what it draws.
        """

        async def handle(requests: AsyncIterator[bytes],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            reservation = await self._admit(name, context, STREAM_MESSAGE_BYTES, wait=False,
                                            waiting=True, stream=True)
            self._read(context, settled=False)  # its messages are counted as they come
            incoming = requests.__aiter__()
            try:
                first = await self.in_time(context, incoming.__anext__,
                                           self.limits.request_timeout_s,
                                           self._silent(f"{name}: the first message"))
            except StopAsyncIteration:  # half-closed without a word: the behaviour sees that
                first = None
            self._spoke(context)
            answers = behaviour(self._counted(context, first, incoming), context, reservation)
            try:
                async for message in answers:
                    yield message
            finally:  # the behaviour's cleanup (a ring unlinked) before the slot is free:
                try:  # whoever waits for the streams to end (a shard's drain) finds it done
                    await _closed(answers)
                finally:
                    self._leave(context)

        return grpc.stream_stream_rpc_method_handler(handle)

    async def _admit(self, name: str, context: grpc.aio.ServicerContext, default: int,
                     wait: bool, waiting: bool = False, stream: bool = False) -> Reservation:
        """Count the call (in the waiting pool if ``waiting``; a ``stream`` there and against
        ``max_streams``) and reserve its request's memory (what it declared, else
        ``default``; waiting for room if ``wait``), or end it with RESOURCE_EXHAUSTED."""
        peer = _peer(context)  # asked while the call lives (its end's callback must not ask)
        if self.on_call is not None:
            self.on_call(peer)
        host = peer_host(peer)
        refusal = self._full(name, host, waiting, stream)
        if refusal is not None:
            if self.on_unread is not None:
                self.on_unread(peer, 0)
            await abort(context, refusal)
        ended = _Ended(self, waiting, id(context), peer, host, stream)
        self.streams += stream
        if stream:
            self.shares.take(host, STREAMS)
        if waiting:
            self.waiting += 1
            self.shares.take(host, WAITING)
        else:
            self.in_flight += 1
            self.shares.take(host, WORKING)
        self._tickets[id(context)] = ended
        context.add_done_callback(ended)
        declared = declared_request_bytes(context.invocation_metadata(), default,
                                          self.limits.max_message_bytes)
        purpose = f"{name}: its request"
        # The call's reservation, owned by its end: whatever the call reserves later is a
        # part of it, released with it on every path (budget.py).
        reservation = ended.reservation = Reservation(self.budget)
        try:
            reservation.resize(declared, purpose)
        except OverloadedError as exc:
            if not wait:
                self._spoke(context)  # refused by the server: no reset (reset_meter)
                await abort(context, exc)
            await self._grow_within(reservation, declared, purpose, context, exc)
        except LimitExceededError as exc:
            self._spoke(context)
            await abort(context, exc)
        if self.on_expect is not None:
            ended.expected = reservation.nbytes
            self.on_expect(peer, ended.expected)
        return reservation

    def _read(self, context: grpc.aio.ServicerContext, settled: bool = True) -> None:
        """The request of the call of ``context`` was read whole, or (a stream, not
        ``settled``) is counted as it comes: its end is no call ended unread, and (``settled``)
        no bytes of it are on their way any more."""
        ticket = self._tickets.get(id(context))
        if ticket is not None:
            ticket.read = True
            if settled:
                ticket.settle()

    def _heard(self, context: grpc.aio.ServicerContext, message: object) -> None:
        """A request message of the call of ``context`` was read: tell ``on_message``."""
        if self.on_message is not None and isinstance(message, bytes):
            self.on_message(_peer(context), len(message))

    async def _counted(self, context: grpc.aio.ServicerContext, first: bytes | None,
                       rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A stream's messages (:func:`_after`), each told to ``on_message``."""
        on_message, peer = self.on_message, _peer(context)
        async for message in _after(first, rest):
            if on_message is not None:
                on_message(peer, len(message))
            yield message

    def _leave(self, context: grpc.aio.ServicerContext) -> None:
        """The handler of the call of ``context`` returned (or raised): its slot is free for
        the next call. Its memory stays reserved until gRPC ends the call."""
        if (ticket := self._tickets.get(id(context))) is not None:
            ticket.free_slot()

    def _spoke(self, context: grpc.aio.ServicerContext) -> None:
        """The call of ``context`` sent its first message (or half-closed): it was no reset."""
        ticket = self._tickets.get(id(context))
        if ticket is not None:
            ticket.spoke = True

    def start_waiting(self, context: grpc.aio.ServicerContext) -> None:
        """The call of ``context`` is about to wait: it moves to the waiting pool (no-op if
        it is there already, or was not admitted here).

        Raises:
            OverloadedError: the waiting pool is full (the caller ends the call with it;
                nothing of it ran).
        """
        ticket = self._tickets.get(id(context))
        if ticket is None or ticket.waiting:
            return
        refusal = self._full("the call", ticket.host, waiting=True)
        if refusal is not None:
            raise refusal
        ticket.waiting = True
        self.in_flight -= 1
        self.waiting += 1
        self.shares.give(ticket.host, WORKING)
        self.shares.take(ticket.host, WAITING)

    def _full(self, name: str, host: str, waiting: bool,
              stream: bool = False) -> OverloadedError | None:
        """Why a call from ``host`` (``waiting``: one that will wait; ``stream``: a stream)
        cannot be admitted now, if it cannot: a pool's cap, then ``host``'s share of it."""
        if stream and self.streams >= self.limits.max_streams:
            self.refused += 1
            return OverloadedError(
                f"{name}: server.max_streams = {self.limits.max_streams} streams are open "
                f"already; the stream was not started: try again later, or raise "
                f"server.max_streams")
        if waiting and self.waiting >= self.limits.max_waiting_calls:
            self.refused += 1
            return OverloadedError(
                f"{name}: server.max_waiting_calls = {self.limits.max_waiting_calls} calls "
                f"(streams, and calls waiting for data, a newer version or a rate limiter) "
                f"are waiting already; the call was not run: try again later")
        if not waiting and self.in_flight >= self.limits.max_concurrent_calls:
            self.refused += 1
            return OverloadedError(
                f"{name}: the server is serving server.max_concurrent_calls = "
                f"{self.limits.max_concurrent_calls} calls already; the call was not run: try "
                f"again later")
        refusal = (self.shares.refusal(name, host, STREAMS, "the stream was not started")
                   if stream else None)
        if refusal is None:
            refusal = self.shares.refusal(name, host, WAITING if waiting else WORKING,
                                          "the call was not run")
        if refusal is not None:
            self.refused += 1
        return refusal

    async def _grow_within(self, reservation: Reservation, nbytes: int, purpose: str,
                           context: grpc.aio.ServicerContext, refusal: OverloadedError) -> None:
        """Grow ``reservation`` to ``nbytes``, waiting up to ``memory_wait_s`` (within the
        deadline) for room, or end the call with ``refusal``."""
        remaining = context.time_remaining()
        wait = self.limits.memory_wait_s
        timeout = wait if remaining is None else min(wait, remaining)
        try:
            await asyncio.wait_for(self.budget.wait(nbytes, purpose, reservation,
                                                    peer=peer_host(_peer(context))),
                                   max(0.0, timeout))
        except TimeoutError:
            self._spoke(context)  # the server refused it: no reset (reset_meter)
            await abort(context, refusal)

    async def _check_size(self, name: str, raw: bytes, reservation: Reservation,
                          context: grpc.aio.ServicerContext) -> None:
        if len(raw) > reservation.nbytes:
            await abort(context, CodecError(
                f"{name}: the request has {len(raw)} bytes but the call declared "
                f"{reservation.nbytes} (metadata replay-request-bytes)"))

    def describe(self) -> dict[str, int]:
        return {"calls_in_flight": self.in_flight, "calls_waiting": self.waiting,
                "calls_refused": self.refused}


class _Ended:
    """A call's done-callback: its slot (unless :meth:`free_slot` gave it back when its
    handler returned) and its memory are free."""

    __slots__ = ("_admission", "reservation", "waiting", "_key", "_stream", "spoke", "read",
                 "expected", "peer", "host", "_holds_slot")

    def __init__(self, admission: Admission, waiting: bool, key: int, peer: str, host: str,
                 stream: bool = False) -> None:
        self._admission = admission
        self.reservation: Reservation | None = None
        self.waiting = waiting
        self._key = key
        self._stream = stream
        self.spoke = False
        self.read = False
        self.expected = 0  # request bytes declared and not read yet (told to on_expect)
        self.peer = peer  # gRPC's peer string, asked while the call lived
        self.host = host  # its address (peer_host): what the call holds counts against it
        self._holds_slot = True

    def free_slot(self) -> None:
        """Give back the call's slot (working or waiting, and its stream's); idempotent."""
        if not self._holds_slot:
            return
        self._holds_slot = False
        admission = self._admission
        admission.streams -= self._stream
        if self._stream:
            admission.shares.give(self.host, STREAMS)
        if self.waiting:
            admission.waiting -= 1
            admission.shares.give(self.host, WAITING)
        else:
            admission.in_flight -= 1
            admission.shares.give(self.host, WORKING)

    def settle(self) -> None:
        """No request bytes of this call are on their way any more: take back the expected."""
        if self.expected and self._admission.on_expect is not None:
            self._admission.on_expect(self.peer, -self.expected)
        self.expected = 0

    def __call__(self, context: grpc.aio.ServicerContext) -> None:
        admission = self._admission
        if not self.spoke and admission.on_silent_end is not None:
            admission.on_silent_end(self.peer)
        elif self.spoke and not self.read and admission.on_unread is not None:
            admission.on_unread(self.peer, self.expected)
        self.settle()
        self.free_slot()
        if admission._tickets.get(self._key) is self:
            del admission._tickets[self._key]
        if self.reservation is not None:
            self.reservation.release()


async def _closed(answers: AsyncIterator[bytes]) -> None:
    """Close the async generator ``answers`` now, not when the loop's finalizer gets to it."""
    close = getattr(answers, "aclose", None)
    if close is not None:
        await close()


async def _after(first: bytes | None, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first`` (if any), then ``rest``: a stream's messages once its first one was read."""
    if first is None:
        return
    yield first
    async for message in rest:
        yield message


def _peer(context: grpc.aio.ServicerContext) -> str:
    try:
        return context.peer() or "unknown"
    except Exception:  # a context that has no peer (a test double)
        return "unknown"
