"""``UpdateStream``: a client's small requests on one persistent stream, answered one by one.

A learner that waits for each priority update pays a whole unary call per
step (about 0.6 ms of Python gRPC here); on a stream that is open already,
a request and its answer are two messages (about 0.4 ms, see
``docs/benchmarks.md``). :class:`UpdateStreamHandler` serves such streams:
it reads requests in order, runs each through the
:class:`~replay_server.service.calls.CallRunner` exactly as the unary
handler would (engine pool, never the event loop), and answers each with
its result or with the error the unary call would have ended with, so
errors stay typed per request and a refused request changes nothing. The
message order is documented on the RPC in ``replay.proto``.

The one exception to "never on the event loop": an update of at most
:data:`INLINE_MAX_IDS` ids whose table's lock is free this instant is applied
right there (tens of microseconds of numpy, never waiting for the lock),
which saves the two thread hand-offs of the pool (about 0.1 ms of a 0.8 ms
round trip on the 2-core machine). A larger update, or one whose table is
busy, goes to the pool like every other call.

Bounds: the call is admitted like every other
(:mod:`replay_server.service.admission`); its reservation covers one message
of the size the call declared (64 KiB unless the ``replay-request-bytes``
metadata says otherwise) and as much again for the decoded ids, and a larger
message ends the stream with INVALID_ARGUMENT. One request is handled at a
time per stream, and the next is read only after the previous one is
answered, so a stream holds at most one decoded request; gRPC's flow control
holds back the rest. Clients keep their own window of unanswered requests
and send larger updates as unary calls. When the server starts draining, a
stream waiting for its next request ends at once with UNAVAILABLE (an idle
learner's stream must not hold the shutdown for its whole grace).

Thread-safety: event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from replay_proto import messages
from replay_proto.codec import CodecError
from replay_proto.error_kinds import ErrorKind
from replay_proto.v1 import replay_pb2 as pb
from replay_server.errors import InvalidArgumentError
from replay_server.service.budget import Reservation
from replay_server.service.calls import CallRunner
from replay_server.service.status import ShuttingDownError, status_of

log = logging.getLogger("replay_server.service")

UpdateFn = Callable[[pb.UpdatePrioritiesRequest], tuple[str, pb.UpdatePrioritiesResponse]]
"""Applies one update in the engine pool: ``request -> (table, response)``."""

UpdateNowFn = Callable[[pb.UpdatePrioritiesRequest], "pb.UpdatePrioritiesResponse | None"]
"""Applies one small update at once if its table is free this instant, else returns ``None``."""

INLINE_MAX_IDS = 4096
"""Updates of at most this many ids may run on the event loop (see the module docstring)."""


class UpdateStreamHandler:
    """Serves every UpdateStream call (see the module docstring); :meth:`serve` is the handler.

    Args:
        calls: runs engine work and ends a call with an error's status.
        update: applies one priority update in the engine pool (the unary handler's work).
        update_now: applies one small update at once if its table is free, else ``None``.
    """

    def __init__(self, calls: CallRunner, update: UpdateFn,
                 update_now: UpdateNowFn | None = None) -> None:
        self._calls = calls
        self._update = update
        self._update_now = update_now
        self._idle: set[asyncio.Task] = set()  # calls waiting for their client's next request
        calls.on_drain.append(self._end_idle)

    def _end_idle(self) -> None:
        """Draining started: streams waiting for a request end now (UNAVAILABLE), so a
        learner's open stream does not hold the server's shutdown for its whole grace."""
        for task in list(self._idle):
            task.cancel()

    async def serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                    reservation: Reservation) -> AsyncIterator[bytes]:
        """One call: answer each request in order (the admitted handler gRPC runs)."""
        calls = self._calls
        declared = reservation.nbytes
        try:  # one message and its decoded ids, held while the stream is open
            reservation.resize(2 * declared, "UpdateStream")
        except Exception as exc:
            await calls.fail(context, exc)
        task = asyncio.current_task()
        assert task is not None
        incoming = requests.__aiter__()
        expected = 0
        while True:
            if calls.draining:
                await calls.fail(context, ShuttingDownError("the server is shutting down"))
            self._idle.add(task)
            try:
                raw = await incoming.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not calls.draining:
                    raise
                await calls.fail(context, ShuttingDownError("the server is shutting down"))
            finally:
                self._idle.discard(task)
            if len(raw) > declared:
                await calls.fail(context, InvalidArgumentError(
                    f"an UpdateStream message of {len(raw)} bytes is larger than the call "
                    f"declared ({declared} bytes, metadata replay-request-bytes)"))
            try:
                sequence, request = messages.decode_update_stream_request(raw)
            except CodecError as exc:
                await calls.fail(context, exc)
            if sequence != expected:
                await calls.fail(context, InvalidArgumentError(
                    f"UpdateStream: message with sequence {sequence} where {expected} was "
                    f"expected (sequences start at 0 and go up by one per message)"))
            expected += 1
            answer = pb.UpdateStreamResponse(sequence=sequence)
            try:
                answer.update_priorities.CopyFrom(await self._apply(request, context))
            except ShuttingDownError as exc:
                answer.error.CopyFrom(_call_error(exc))
                yield answer.SerializeToString()
                await calls.fail(context, exc)
            except Exception as exc:
                answer.error.CopyFrom(_call_error(exc))
            yield answer.SerializeToString()

    async def _apply(self, request: pb.UpdatePrioritiesRequest,
                     context: grpc.aio.ServicerContext) -> pb.UpdatePrioritiesResponse:
        """The update's result: at once on the loop when small and its table is free, else in the pool."""
        calls = self._calls
        refused = calls.refusal()
        if refused is not None:
            raise refused
        if self._update_now is not None:
            result = self._update_now(request)
            if result is not None:
                calls.blocked.changed(request.table)
                return result
        return await calls.change(context, self._update, request, aborting=False)


def _call_error(exc: BaseException) -> pb.CallError:
    """What the unary call's status would have said about ``exc`` (a bug: logged, INTERNAL)."""
    mapped = status_of(exc)
    if mapped is None:
        log.error("internal error while serving an UpdateStream request", exc_info=exc)
        return pb.CallError(code=grpc.StatusCode.INTERNAL.name, kind=ErrorKind.INTERNAL.value,
                            message="internal server error (the server logged the details)")
    code, kind = mapped
    return pb.CallError(code=code.name, kind=kind.value, message=str(exc))
