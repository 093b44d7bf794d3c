"""Reading a chunked request (``InsertChunks``, ``PublishChunks``) within the memory budget.

A chunked transfer (:mod:`replay_proto.chunks`) says in its first message
how large the whole request is. The call was admitted holding what it
declared for one message (:mod:`replay_server.service.admission`); before
the second message is read, its reservation grows to the whole request
plus one message in hand (waiting up to a second for room, else
RESOURCE_EXHAUSTED), so nothing read from then on is held unreserved. Each
later message must fit what the call declared, and all of them together the
size the first announced; anything else ends the call (INVALID_ARGUMENT,
kind ``malformed_request``) with nothing run. Each later message must come
within ``server.request_timeout_s`` of the previous one (the progress
deadline): a stalled upload is ended (DEADLINE_EXCEEDED) and its
reservation freed, so it cannot hold the budget other callers wait for.

What gRPC buffers before this code sees a message is bounded by the
transport (one message of at most ``max_message_mb`` per call, plus its
stream's flow-control window), not by the client's word: docs/service.md,
"Limits".

Thread-safety: event-loop only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from replay_proto.chunks import Reassembly
from replay_proto.codec import CodecError
from replay_server.service.budget import Reservation
from replay_server.service.status import abort

Grow = Callable[[Reservation, int, str, grpc.aio.ServicerContext], Awaitable[None]]
"""``grow(reservation, nbytes, purpose, context)``: grow it to ``nbytes`` or end the call."""
Read = Callable[[], Awaitable[bytes]]
"""``read()``: the call's next message (or ``grpc.aio.EOF``), ending the call if it does not
come within the progress deadline."""


async def read_chunked(first: bytes, message_type: type, context: grpc.aio.ServicerContext,
                       reservation: Reservation, grow: Grow, name: str,
                       read: Read) -> bytes | memoryview:
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
        read: reads the next message within the progress deadline (see :data:`Read`).
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
        while True:
            raw = await read()
            if raw is grpc.aio.EOF:
                return transfer.message()
            if len(raw) > declared:
                raise CodecError(f"{name}: a message has {len(raw)} bytes but the call declared "
                                 f"{declared} (metadata replay-request-bytes)")
            transfer.add(raw)
            del raw
    except CodecError as exc:
        refusal = exc
    finally:
        raw = None  # neither this message nor the buffer lives on in the call's traceback
        if refusal is not None or not transfer.complete:
            transfer.release()
    await abort(context, refusal)
    raise AssertionError("unreachable")  # pragma: no cover - abort raises
