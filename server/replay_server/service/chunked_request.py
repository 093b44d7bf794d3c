"""Reading a chunked request (``InsertChunks``, ``PublishChunks``) within the memory budget.

A chunked transfer (:mod:`replay_proto.chunks`) says in its first message
how large the whole request is. The call was admitted holding what it
declared for one message (:mod:`replay_server.service.admission`); before
the second message is read, its reservation grows to the whole request
plus one message in hand (waiting up to a second for room, else
RESOURCE_EXHAUSTED), so nothing read from then on is held unreserved. Each
later message must fit what the call declared, and all of them together the
size the first announced; anything else ends the call (INVALID_ARGUMENT,
kind ``malformed_request``) with nothing run.

**Progress deadline.** The request is reserved whole, so a transfer must
move: each later message must come within ``server.request_timeout_s`` of
the previous one, and the transfer as a whole at a pace of one message
(of the size the call declared) per ``request_timeout_s`` on average (its
time runs out ``request_timeout_s x (1 + bytes received / declared)`` after
the reservation was granted). A transfer that stalls, or trickles (a byte
every few seconds), is ended (DEADLINE_EXCEEDED) and its reservation
freed, so it cannot hold the budget other callers wait for (one stalled
upload held 760 of 768 MiB for 83 s). A client sending full messages gains
``request_timeout_s`` with each.

What gRPC buffers before this code sees a message is bounded by the
transport (one message of at most ``max_message_mb`` per call, plus its
stream's flow-control window), not by the client's word: docs/service.md,
"Limits".

Thread-safety: event-loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from replay_proto.chunks import Reassembly
from replay_proto.codec import CodecError
from replay_server.service.budget import Reservation
from replay_server.service.status import abort

Grow = Callable[[Reservation, int, str, grpc.aio.ServicerContext], Awaitable[None]]
"""``grow(reservation, nbytes, purpose, context)``: grow it to ``nbytes`` or end the call."""
Read = Callable[[float, str], Awaitable[bytes]]
"""``read(seconds, why)``: the call's next message (or ``grpc.aio.EOF``), ending the call
(DEADLINE_EXCEEDED, saying ``why``) if it does not come within ``seconds``."""


async def read_chunked(first: bytes, message_type: type, context: grpc.aio.ServicerContext,
                       reservation: Reservation, grow: Grow, name: str,
                       read: Read, timeout_s: float) -> bytes | memoryview:
    """The one-message form of the transfer that starts with ``first``.

    Args:
        first: the call's first message (read; ``reservation`` holds what the
            call declared for one message, at least its size).
        message_type: the messages' protobuf type.
        context: the call (ended with its status on any refusal).
        reservation: the call's memory; it ends holding the whole request plus
            one message.
        grow: grows the reservation, waiting for room (see :data:`Grow`).
        name: the RPC, for messages.
        read: reads the next message within a deadline (see :data:`Read`).
        timeout_s: ``server.request_timeout_s``, the progress deadline's unit.
    """
    declared = reservation.nbytes
    try:
        transfer = Reassembly(first, message_type)
    except CodecError as exc:
        await abort(context, exc)
    if not transfer.chunked:
        return first
    await grow(reservation, transfer.nbytes + declared,
               f"{name}: a request of {transfer.nbytes} bytes", context)
    refusal, raw = None, None
    try:
        transfer.allocate()
        del first
        pace = _Pace(name, declared, transfer.nbytes, timeout_s)
        while True:
            raw = await read(*pace.next_read())
            if raw is grpc.aio.EOF:
                return transfer.message()
            if len(raw) > declared:
                raise CodecError(f"{name}: a message has {len(raw)} bytes but the call declared "
                                 f"{declared} (metadata replay-request-bytes)")
            transfer.add(raw)
            pace.received += len(raw)
            del raw
    except CodecError as exc:
        refusal = exc
    finally:
        raw = None  # neither this message nor the buffer lives on in the call's traceback
        if refusal is not None or not transfer.complete:
            transfer.release()
    await abort(context, refusal)
    raise AssertionError("unreachable")  # pragma: no cover - abort raises


class _Pace:
    """A chunked transfer's progress deadline (see the module docstring)."""

    def __init__(self, name: str, declared: int, total: int, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._name, self._declared, self._total = name, max(1, declared), total
        self._timeout = timeout_s
        self.received = 0

    def next_read(self) -> tuple[float, str]:
        """How long the next message may take, and why the call ends if it takes longer."""
        timeout = self._timeout
        allowed = timeout * (1 + self.received / self._declared)
        left = self._started + allowed - self._loop.time()
        if not self.received or left >= timeout:
            return timeout, (f"{self._name}: the next message of a chunked request did not "
                             f"arrive within server.request_timeout_s = {timeout:g} s of the "
                             f"previous one")
        return max(0.0, left), (
            f"{self._name}: a chunked request must move one message of {self._declared} bytes "
            f"(what the call declared) per server.request_timeout_s = {timeout:g} s on "
            f"average; it had sent {self.received} of its {self._total} bytes after "
            f"{allowed:.1f} s")
