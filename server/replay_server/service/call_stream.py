"""``CallStream``: a client's small requests on one persistent stream, answered one by one.

A learner that waits for each priority update, or an actor that inserts a
few rows at a time, pays a whole unary call per request (about 1.1 ms of
server CPU on the 2-core machine, most of it gRPC setting up and tearing
down the call); on a stream that is open already, a request and its answer
are two messages (about 0.35 ms, see ``docs/benchmarks.md``).
:class:`CallStreamHandler` serves such streams (under the names
``CallStream`` and, for clients from before it, ``UpdateStream``): it reads
requests in order, runs each through the
:class:`~replay_server.service.calls.CallRunner` exactly as the unary
handler would (engine pool, never the event loop; inserts held back by a
rate limiter wait holding no thread, up to the request's ``timeout_s``), and
answers each with its result or with the error the unary call would have
ended with, so errors stay typed per request and a refused request changes
nothing. The message order is documented on the RPC in ``replay.proto``.

The exceptions to "never on the event loop", each taken only when it cannot
wait: an update of at most :data:`INLINE_MAX_IDS` ids whose table's lock is
free this instant is applied right there (tens of microseconds of numpy),
and so is an insert of at most :data:`INLINE_MAX_INSERT_BYTES` into a table whose
lock is free and whose columns are plain host memory, allocated
(``Table.insert_now``: about 0.2-0.3 ms of Python for 64 small rows, which
the pool's two thread hand-offs would cost again on top; a table that keeps
columns on a device, on disk or compressed is never written on the loop; one
that logs its changes is, and the answer then awaits its record's
durability holding no thread: ``Table.insert_now_durable``). Each saves the
hand-offs (0.25-0.3 ms of the server's
CPU per small insert on the 2-core machine, ``docs/benchmarks.md``). A larger
update, a busy table, and an insert held back by its rate limiter (it then
waits holding no thread) go to the pool like every other call.

A client on the server's host may also ask for a shared-memory region for
its inserts (:mod:`~replay_server.service.call_region`): then a large
insert's bytes lie in /dev/shm and its request says only how many
(``insert_in_region``), handled in the pool as a large insert is. Its sample
stream's samples go the other way (``sample_in_region``,
:mod:`~replay_server.service.region_sample`): drawn in the pool straight into
the region, waiting as a unary Sample waits, answered with where the batch lies.
Its update stream may move its waiting updates to a Unix socket
(``local_channel``, :mod:`~replay_server.service.local_updates`), each handled as
here.

Bounds: the call is admitted like every other
(:mod:`replay_server.service.admission`; call streams may hold at most half
of ``max_streams``, so actors' streams never take the learners' sample
streams' room); its reservation covers one message of the size the call
declared (64 KiB unless the ``replay-request-bytes`` metadata says
otherwise) and as much again for what decoding it makes (an update's ids;
an insert's columns are views of the message until the table copies them),
and a larger message ends the stream with INVALID_ARGUMENT. One request is
handled at a time per stream, and the next is read only after the previous
one is answered, so a stream holds at most one decoded request and a broken
stream leaves only its oldest unanswered request in doubt; gRPC's flow
control holds back the rest. Clients keep their own window of unanswered
requests and send larger ones as unary calls. When the server starts
draining, a stream waiting for its next request ends at once with
UNAVAILABLE (an idle learner's stream must not hold the shutdown for its
whole grace).

Thread-safety: event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from replay_proto import messages
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES
from replay_proto.codec import CodecError
from replay_proto.error_kinds import ErrorKind
from replay_proto.v1 import replay_pb2 as pb
from replay_server.errors import FailedPreconditionError, InvalidArgumentError, RateLimitedError
from replay_server.service.budget import Reservation
from replay_server.service.calls import CallRunner
from replay_server.service.excerpt import STATUS_CHARS, excerpt
from replay_server.service.call_region import CallRegion
from replay_server.service.local_updates import LocalChannel, LocalUpdates
from replay_server.service.status import OverloadedError, ShuttingDownError, status_of

log = logging.getLogger("replay_server.service")

UpdateFn = Callable[[pb.UpdatePrioritiesRequest], tuple[str, pb.UpdatePrioritiesResponse]]
"""Applies one update in the engine pool: ``request -> (table, response)``."""

Counted = Callable[[str, str, float, int, "int | None"], None]
"""``(method path, status code name, seconds, request bytes, answer bytes or None: no answer)``
of one request."""

InsertFn = Callable[[bytes | memoryview], tuple[str, pb.InsertResponse]]
"""Applies one insert (an Insert request's bytes) in the engine pool: ``-> (table, response)``."""

UpdatedNow = tuple[pb.UpdatePrioritiesResponse, "asyncio.Future[None] | None"]
"""An update applied at once: its answer, and what the answer waits for first (a logged
table's record to be durable; ``None``: nothing)."""

UpdateNowFn = Callable[[pb.UpdatePrioritiesRequest], "UpdatedNow | None"]
"""Applies one small update at once if its table is free this instant, else returns ``None``."""

InsertedNow = tuple[str, pb.InsertResponse, "asyncio.Future[None] | None"]
"""An insert stored at once: its table, its answer, and what the answer waits for first (a
logged table's record to be durable; ``None``: nothing)."""

SampleFn = Callable[[bytes, CallRegion], tuple[str, pb.SampledInRegion]]
"""Draws one sample (a SampleRequest's bytes) into the stream's region in the engine pool:
``-> (table, answer)``."""

InsertNowFn = Callable[[bytes], "InsertedNow | None"]
"""Stores one small insert at once if that is quick now (``Table.insert_now_durable``), else
``None``."""

_SERVICE = pb.DESCRIPTOR.services_by_name["ReplayService"].full_name
_INSERT = f"/{_SERVICE}/Insert"
_UPDATE = f"/{_SERVICE}/UpdatePriorities"
_SAMPLE = f"/{_SERVICE}/Sample"
"""The unary calls that requests on a call stream stand for (in the metrics)."""

INLINE_MAX_IDS = 4096
"""Updates of at most this many ids may run on the event loop (see the module docstring)."""

INLINE_MAX_INSERT_BYTES = STREAM_MESSAGE_BYTES
"""Inserts of at most this many bytes may run on the event loop (a client may declare larger
messages for its stream; those inserts go to the pool)."""


class CallStreamHandler:
    """Serves every CallStream call (see the module docstring); :meth:`serve` is the handler.

    Args:
        calls: runs engine work and ends a call with an error's status.
        update: applies one priority update in the engine pool (the unary handler's work).
        insert: applies one insert in the engine pool (the unary handler's work).
        update_now: applies one small update at once if its table is free, else ``None``.
        insert_now: stores one insert at once if that is quick now, else ``None``.
        region: makes a stream's shared-memory region for inserts and samples
            (:mod:`~replay_server.service.call_region`; ``None``: none is offered).
        sample: draws one sample into a stream's region in the engine pool (``None``:
            ``sample_in_region`` is refused).
        local: the server's socket for same-host updates
            (:mod:`~replay_server.service.local_updates`; ``None``: none is offered).
        max_streams: the server's ``max_streams``; call streams may hold half of it (at
            least one), the rest stays for sample streams.
    """

    def __init__(self, calls: CallRunner, update: UpdateFn, insert: InsertFn,
                 update_now: UpdateNowFn | None = None, insert_now: InsertNowFn | None = None,
                 *, region: Callable[[], CallRegion] | None = None,
                 sample: SampleFn | None = None, local: LocalUpdates | None = None,
                 max_streams: int) -> None:
        self.max_open = max(1, max_streams // 2)
        """Call streams open at once at most (see the module docstring)."""
        self.open = 0
        """Call streams open now."""
        self.counted: Counted | None = None
        """Told of every request handled, as the unary call it stands for (the metrics)."""
        self._calls = calls
        self._update = update
        self._insert = insert
        self._update_now = update_now
        self._insert_now = insert_now
        self._region = region
        self._sample = sample
        self._local = local
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
        if self.open >= self.max_open:  # before any request is handled
            await calls.fail(context, OverloadedError(
                f"{self.max_open} call streams (half of server.max_streams) are open already; "
                f"the stream was not started (the client makes plain calls instead)"))
        self.open += 1
        region = None if self._region is None else self._region()
        channel = LocalChannel(lambda request: self._local_answer(request, context))
        try:
            async for answer in self._serve(requests, context, reservation, region, channel):
                yield answer
        finally:
            self.open -= 1
            channel.close()
            if region is not None:
                region.close()

    async def _serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                     reservation: Reservation,
                     region: CallRegion | None,
                     channel: LocalChannel) -> AsyncIterator[bytes]:
        calls = self._calls
        declared = reservation.nbytes
        try:  # one message and what decoding it makes, held while the stream is open
            reservation.resize(2 * declared, "CallStream")
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
                    f"a CallStream message of {len(raw)} bytes is larger than the call "
                    f"declared ({declared} bytes, metadata replay-request-bytes)"))
            try:
                request = messages.decode_call_request(raw)
            except CodecError as exc:
                await calls.fail(context, exc)
            if request.sequence != expected:
                await calls.fail(context, InvalidArgumentError(
                    f"CallStream: message with sequence {request.sequence} where {expected} "
                    f"was expected (sequences start at 0 and go up by one per message)"))
            expected += 1
            answer = pb.CallStreamResponse(sequence=request.sequence)
            started = time.perf_counter()
            kind = request.WhichOneof("call")
            try:
                if kind == "insert":
                    answer.insert.CopyFrom(await self._apply_insert(request, context))
                elif kind == "insert_in_region":
                    answer.insert.CopyFrom(await self._insert_in_region(
                        request, context, _region(region)))
                elif kind == "sample_in_region":
                    answer.sampled_in_region.CopyFrom(await self._sample_in_region(
                        request, context, _region(region)))
                elif kind == "local_channel":
                    if self._local is None:
                        raise FailedPreconditionError("this server offers no local channel")
                    answer.local_channel.CopyFrom(
                        await self._local.offer(channel, request.local_channel))
                elif kind == "insert_region":  # reserving its pages takes time: the pool's
                    answer.region_offer.CopyFrom(await asyncio.get_running_loop().run_in_executor(
                        calls.executor, _region(region).open, request.insert_region))
                elif kind == "region_answer":
                    answer.region_answer.CopyFrom(
                        _region(region).answered(request.region_answer))
                else:
                    answer.update_priorities.CopyFrom(
                        await self._apply(request.update_priorities, context))
            except ShuttingDownError as exc:
                answer.error.CopyFrom(_call_error(exc))
                self._count(kind, request, answer, started)
                yield answer.SerializeToString()
                await calls.fail(context, exc)
            except Exception as exc:
                answer.error.CopyFrom(_call_error(exc))
            self._count(kind, request, answer, started)
            yield answer.SerializeToString()

    def _count(self, kind: str, request: pb.CallStreamRequest, answer: pb.CallStreamResponse,
               started: float) -> None:
        """Tell :attr:`counted` of one handled request, as the unary call it stands for."""
        if self.counted is None or kind in ("insert_region", "region_answer",
                                             "local_channel") or (
                kind == "sample_in_region" and answer.sampled_in_region.region_bytes):
            return  # region control: no call a client made (a sample that found its
            # region too small is made again, and counted then)
        if kind == "insert":
            path, received, sent = _INSERT, len(request.insert), answer.insert.ByteSize()
        elif kind == "insert_in_region":
            path, received = _INSERT, request.insert_in_region
            sent = answer.insert.ByteSize()
        elif kind == "sample_in_region":
            path, received = _SAMPLE, len(request.sample_in_region)
            sent = answer.sampled_in_region.ByteSize()
        else:
            path, received = _UPDATE, request.update_priorities.ByteSize()
            sent = answer.update_priorities.ByteSize()
        failed = answer.HasField("error")
        self.counted(path, answer.error.code if failed else "OK", time.perf_counter() - started,
                     received, None if failed else sent)

    def _local_answer(self, request: pb.CallStreamRequest, context: grpc.aio.ServicerContext
                      ) -> pb.CallStreamResponse | Awaitable[pb.CallStreamResponse]:
        """An update that came over the stream's local channel, answered as on the stream:
        at once when it was applied on the loop now (:meth:`_apply`'s first case), else the
        answer to await."""
        calls = self._calls
        update = request.update_priorities
        if self._update_now is None or calls.refusal() is not None:
            return self._local_later(request, context)
        answer = pb.CallStreamResponse(sequence=request.sequence)
        started = time.perf_counter()
        try:
            done = self._update_now(update)
        except Exception as exc:
            answer.error.CopyFrom(_call_error(exc))
            self._count("update_priorities", request, answer, started)
            return answer
        if done is None:  # its table is busy: the pool
            return self._local_later(request, context)
        result, logged = done
        calls.blocked.changed(update.table)
        answer.update_priorities.CopyFrom(result)
        if logged is None:
            self._count("update_priorities", request, answer, started)
            return answer
        return self._local_logged(request, answer, logged, started)

    async def _local_logged(self, request: pb.CallStreamRequest, answer: pb.CallStreamResponse,
                            logged: asyncio.Future[None], started: float
                            ) -> pb.CallStreamResponse:
        """An update applied on the loop whose answer waits for its log record."""
        try:
            await logged
        except Exception as exc:
            answer.ClearField("update_priorities")
            answer.error.CopyFrom(_call_error(exc))
        self._count("update_priorities", request, answer, started)
        return answer

    async def _local_later(self, request: pb.CallStreamRequest,
                           context: grpc.aio.ServicerContext) -> pb.CallStreamResponse:
        """An update from the local channel through :meth:`_apply` (the pool, or a refusal)."""
        answer = pb.CallStreamResponse(sequence=request.sequence)
        started = time.perf_counter()
        try:
            answer.update_priorities.CopyFrom(
                await self._apply(request.update_priorities, context))
        except Exception as exc:
            answer.error.CopyFrom(_call_error(exc))
        self._count("update_priorities", request, answer, started)
        return answer

    async def _apply(self, request: pb.UpdatePrioritiesRequest,
                     context: grpc.aio.ServicerContext) -> pb.UpdatePrioritiesResponse:
        """The update's result: at once on the loop when small and its table is free, else in the pool."""
        calls = self._calls
        refused = calls.refusal()
        if refused is not None:
            raise refused
        if self._update_now is not None:
            done = self._update_now(request)
            if done is not None:
                result, logged = done
                calls.blocked.changed(request.table)
                if logged is not None:
                    await logged  # its log record durable (or the log's error, answered)
                return result
        return await calls.change(context, self._update, request, aborting=False)

    async def _apply_insert(self, request: pb.CallStreamRequest,
                            context: grpc.aio.ServicerContext) -> pb.InsertResponse:
        """The insert's result: at once on the loop when that is quick (``insert_now``), else
        from the pool, waiting up to the request's ``timeout_s`` (0: the server's
        ``default_wait_s``) while its table's rate limiter holds it back."""
        calls = self._calls
        if (self._insert_now is not None and len(request.insert) <= INLINE_MAX_INSERT_BYTES
                and calls.refusal() is None):
            try:
                done = self._insert_now(request.insert)
            except RateLimitedError:
                done = None  # held back: it waits below, holding no thread
            if done is not None:
                table, result, logged = done
                calls.blocked.changed(table)
                if logged is not None:
                    await logged  # its log record durable (or the log's error, answered)
                return result
        return await calls.change(context, self._insert, request.insert, aborting=False,
                                  time_remaining=self._remaining(request))

    async def _insert_in_region(self, request: pb.CallStreamRequest,
                                context: grpc.aio.ServicerContext,
                                region: CallRegion) -> pb.InsertResponse:
        """An insert whose request lies in the stream's shared-memory region: decoded from it
        (views, no copy) and stored in the pool as :meth:`_apply_insert` stores a large one.
        Its bytes are the region's (counted in ``shared_memory_mb``), so it reserves nothing
        more of ``memory_budget_mb``: what storing makes beyond them (a compressed column's
        blocks) is at most their size, one insert per stream at a time."""
        raw = region.request(request.insert_in_region)
        return await self._calls.change(context, self._insert, raw, aborting=False,
                                        time_remaining=self._remaining(request))

    async def _sample_in_region(self, request: pb.CallStreamRequest,
                                context: grpc.aio.ServicerContext,
                                region: CallRegion) -> pb.SampledInRegion:
        """A sample drawn into the stream's region in the pool, waiting (holding no thread)
        up to the request's ``timeout_s`` while its table cannot serve it, as the unary
        Sample waits. The region's bytes are counted in ``shared_memory_mb``: nothing of
        ``memory_budget_mb`` is reserved for the batch."""
        if self._sample is None:
            raise FailedPreconditionError("this server samples into no shared-memory region")
        return await self._calls.change(context, self._sample, request.sample_in_region, region,
                                        aborting=False, time_remaining=self._remaining(request))

    def _remaining(self, request: pb.CallStreamRequest) -> Callable[[], float | None]:
        """How long ``request`` may still wait: its ``timeout_s`` from now, or (0) the
        server's ``default_wait_s``."""
        calls = self._calls
        if request.timeout_s <= 0:
            return lambda: calls.default_wait_s
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + request.timeout_s
        return lambda: give_up_at - loop.time()


def _region(region: CallRegion | None) -> CallRegion:
    """The stream's region keeper, or the refusal of a server that offers none."""
    if region is None:
        raise FailedPreconditionError("this server offers no shared-memory region for inserts")
    return region


def _call_error(exc: BaseException) -> pb.CallError:
    """What the unary call's status would have said about ``exc`` (a bug: logged, INTERNAL)."""
    mapped = status_of(exc)
    if mapped is None:
        log.error("internal error while serving a CallStream request", exc_info=exc)
        return pb.CallError(code=grpc.StatusCode.INTERNAL.name, kind=ErrorKind.INTERNAL.value,
                            message="internal server error (the server logged the details)")
    code, kind = mapped
    return pb.CallError(code=code.name, kind=kind.value, message=excerpt(exc, STATUS_CHARS))
