"""``replay.v1.ReplayService`` handlers: decode, call the engine, encode.

Handlers receive and return raw message bytes (so tensor payloads are never
copied through protobuf fields; see :mod:`replay_proto.codec`). Every call is
admitted first (:mod:`replay_server.service.admission`: a cap on calls in
flight, its request's memory reserved before it is read); a handler grows
the call's reservation before it draws a batch. Engine work,
decoding included, runs through a :class:`~replay_server.service.calls.CallRunner`:
in a bounded thread pool, never on the event loop, waiting without a thread
while a table's rate limiter holds it back. ``SampleStream`` and
``CallStream`` (also served as ``UpdateStream``) are handlers of their own
(:mod:`replay_server.service.sample_stream`,
:mod:`replay_server.service.call_stream`, which applies small priority
updates and small inserts on the event loop when their table is free and
quick to write, else in the pool), sharing the runner.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

import grpc
import numpy as np

from replay_proto import messages
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES
from replay_proto.chunks import chunk_bytes
from replay_proto.codec import CodecError
from replay_proto.sample_codec import HEADROOM, encode_sample
from replay_proto.v1 import replay_pb2 as pb
from replay_server.checkpoint import Checkpointer, CheckpointResult
from replay_server.checkpoint.checkpointer import partial_message
from replay_server.engine import (
    MAX_BATCH_SIZE,
    IncarnationSource,
    LeaseRequest,
    LocalIncarnations,
    Table,
    TableSet,
    VariableStore,
    batch_size_of,
    field_values,
)
from replay_server.errors import CheckpointPartError, CheckpointsDisabledError
from replay_server.service.admission import Admission
from replay_server.service.budget import MemoryBudget, Reservation
from replay_server.service.calls import CallRunner
from replay_server.service.limits import ServiceLimits
from replay_server.service.process import rss_bytes
from replay_server.service.rows import RowService
from replay_server.service.batch_sink import StreamLimits
from replay_server.service.sample_stream import SampleStreamCall
from replay_server.service.status import LimitExceededError, MessageTooLargeError
from replay_server.service.call_stream import (
    INLINE_MAX_IDS,
    CallStreamHandler,
    InsertedNow,
    UpdatedNow,
)
from replay_server.service.call_region import CallRegion
from replay_server.service.local_updates import LocalUpdates
from replay_server.service.region_sample import region_short, sample_in_region
from replay_server.service.variables import VariableService
from replay_server.service.waiting import draw

SERVICE_NAME = "replay.v1.ReplayService"


class ReplayServicer:
    """The service's handlers over a set of tables.

    Args:
        tables: the engine's tables.
        executor: where engine work runs (bounded thread pool).
        max_message_bytes: the gRPC message-size limit, both ways.
        shared_memory: offer same-host learners a shared-memory ring for streams.
        checkpointer: writes checkpoints (``None``: the server has no checkpoint_dir).
        checkpoint_executor: where checkpoint calls wait and run (not the engine's pool).
        variables: the named variables (``None``: an empty store with no budget).
        admission: admits calls (their count and memory); ``None``: the default limits.
        incarnations: the server's shard and id incarnation (for ``info``).
        shared_memory_budget: /dev/shm the streams' rings may take together
            (``None``: the admission limits' ``shared_memory_bytes``).
        server_info: what ``Info`` says of the server (version, TLS, auth); its
            memory and uptime are filled in at each call.
    """

    def __init__(
        self, tables: TableSet, executor: Executor, max_message_bytes: int, *,
        shared_memory: bool = True, checkpointer: Checkpointer | None = None,
        checkpoint_executor: Executor | None = None, admission: Admission | None = None,
        incarnations: IncarnationSource | None = None,
        shared_memory_budget: MemoryBudget | None = None, variables: VariableStore | None = None,
        server_info: pb.ServerInfo | None = None,
    ) -> None:
        if admission is None:  # the default limits (a servicer built outside ReplayServer)
            limits = ServiceLimits.defaults(max_message_bytes)
            admission = Admission(limits, MemoryBudget(limits.memory_budget_bytes))
        if shared_memory_budget is None:
            shared_memory_budget = MemoryBudget(admission.limits.shared_memory_bytes,
                                                "server.shared_memory_mb", bulk_share=1.0)
        self._tables = tables
        self._server_info = server_info or pb.ServerInfo()
        self._started = time.monotonic()
        self._max_message = max_message_bytes
        self._admission = admission
        self._incarnations = incarnations or LocalIncarnations()
        self._stream_limits = StreamLimits(max_message_bytes=max_message_bytes,
                                           shared_memory=shared_memory,
                                           max_batch_bytes=admission.limits.max_batch_bytes,
                                           budget=admission.budget,
                                           shared_memory_budget=shared_memory_budget,
                                           closing_wait_s=admission.limits.response_timeout_s)
        self._checkpointer = checkpointer
        self._checkpoint_executor = checkpoint_executor or executor
        self._streams: set[SampleStreamCall] = set()
        self.calls = CallRunner(executor, self._may_pass)
        """Runs every call's engine work; the server sets its ``draining``/``restoring``."""
        self.connection_figures: Callable[[], tuple[int, int]] = lambda: (0, 0)
        """Connections open on the main port and closed for making no call (for ``info``)."""
        self.calls.start_waiting = admission.start_waiting
        self.calls.default_wait_s = admission.limits.default_wait_s
        self.variables = VariableService(
            VariableStore(0) if variables is None else variables, self.calls, max_message_bytes)
        """Publish and Fetch (named variables)."""
        self._local_updates = LocalUpdates(shared_memory, STREAM_MESSAGE_BYTES)
        self.calls.on_drain.append(self._local_updates.close)
        self.call_streams = CallStreamHandler(self.calls, self._stream_update, self._stream_insert,
                                              self._stream_update_now, self._stream_insert_now,
                                              region=self._call_region,
                                              sample=self._stream_sample,
                                              local=self._local_updates,
                                              max_streams=admission.limits.max_streams)
        """Small updates, inserts and same-host samples on persistent streams (CallStream,
        UpdateStream)."""
        self.rows = RowService(lambda: self._tables, self.calls, max_message_bytes)
        """Read, Write and SetSampling."""
        self.calls.on_drain.append(self._wake_streams)

    def use_tables(self, tables: TableSet) -> None:
        """Serve ``tables`` from now on (the restored ones, before SERVING)."""
        self._tables = tables

    def handler(self) -> grpc.GenericRpcHandler:
        """A generic handler serving every RPC of ``replay.v1.ReplayService``."""
        unary, stream = self._admission.unary, self._admission.stream
        chunked, unary_stream = self._admission.chunked, self._admission.unary_stream
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Insert": unary("Insert", self.insert),
                "InsertChunks": chunked("InsertChunks", pb.InsertRequest, self.insert),
                "Sample": unary("Sample", self.sample),
                "SampleChunks": unary_stream("SampleChunks", self.sample_chunks),
                "SampleStream": stream("SampleStream", self.sample_stream),
                "UpdatePriorities": unary("UpdatePriorities", self.update_priorities),
                "Info": unary("Info", self.info),
                "Reset": unary("Reset", self.reset),
                "Checkpoint": unary("Checkpoint", self.checkpoint),
                "Publish": unary("Publish", self.variables.publish),
                "PublishChunks": chunked("PublishChunks", pb.PublishRequest,
                                         self.variables.publish),
                "Fetch": unary("Fetch", self.variables.fetch),
                "FetchChunks": unary_stream("FetchChunks", self.variables.fetch_chunks),
                "CallStream": stream("CallStream", self.call_streams.serve),
                "UpdateStream": stream("UpdateStream", self.call_streams.serve),
                "Delete": unary("Delete", self.delete),
                "Acknowledge": unary("Acknowledge", self.acknowledge),
                "Read": unary("Read", self.rows.read),
                "Write": unary("Write", self.rows.write),
                "SetSampling": unary("SetSampling", self.rows.set_sampling),
            },
        )

    # ---------------------------------------------------------------- handlers

    async def insert(self, raw: bytes, context: grpc.aio.ServicerContext, _: Reservation) -> bytes:
        return await self.calls.change(context, self._insert, raw)

    def _insert(self, raw: bytes) -> tuple[str, bytes]:
        table, response = self._stream_insert(raw)
        return table, response.SerializeToString()

    def _stream_insert(self, raw: bytes | memoryview) -> tuple[str, pb.InsertResponse]:
        call = messages.decode_insert(raw)
        return call.table, _inserted(self._tables[call.table].insert(call.columns,
                                                                     call.priorities))

    def _call_region(self) -> CallRegion:
        """A call stream's keeper of a shared-memory region for inserts and samples."""
        limits = self._stream_limits
        return CallRegion(limits.shared_memory, limits.shared_memory_budget)

    def _stream_insert_now(self, raw: bytes) -> InsertedNow | None:
        """A small insert stored on the event loop if that is quick now
        (``Table.insert_now_durable``), else ``None`` having stored nothing; a table that logs
        its changes hands back what the answer waits for (its record durable)."""
        call = messages.decode_insert(raw)
        logged = _LoggedFuture()
        done = self._tables[call.table].insert_now_durable(call.columns, call.priorities, logged)
        if done is None:
            return None
        ids, waits = done
        return call.table, _inserted(ids), logged.future if waits else None

    async def sample(self, raw: bytes, context: grpc.aio.ServicerContext,
                     reservation: Reservation) -> bytes:
        return await self.calls.change(context, self._sample, raw, reservation)

    def _sample(self, raw: bytes, reservation: Reservation,
                chunks: bool = False) -> tuple[str, Any]:
        """A batch as one message, or (``chunks``) as SampleChunks' messages."""
        request = _parse(pb.SampleRequest, raw)
        table = self._tables[request.table]
        lease = self._lease(table, request)
        estimate = self._check_unary_size(table, request.batch_size, chunks)
        # The batch and its encoded message, held until the client has taken the answer.
        reservation.resize(len(raw) + 2 * estimate,
                           f"Sample: a batch of {request.batch_size} from table {table.name!r}")
        try:
            batch = draw(table, request.batch_size, wait_for_data=request.wait_for_data,
                         lease=lease, never_wait=request.never_wait)
        except BaseException:
            reservation.resize(len(raw), "")
            raise
        if chunks:
            return request.table, encode_sample(batch, 0, chunk_bytes(self._max_message))
        return request.table, encode_sample(batch, 0, self._max_message)[0]

    def _stream_sample(self, raw: bytes, region: CallRegion) -> tuple[str, pb.SampledInRegion]:
        """A call stream's ``sample_in_region``: the batch gathered into the stream's region,
        or (nothing drawn) the region size it needs (:mod:`~replay_server.service.region_sample`)."""
        request = _parse(pb.SampleRequest, raw)
        table = self._tables[request.table]
        size = batch_size_of(request.batch_size, table.name)  # refused before anything else
        self._check_unary_size(table, size, message=False)
        layout = table.batch_layout(size)
        ring = region.mapped()
        short = region_short(table, size, layout, ring)
        if short or ring is None:
            return request.table, pb.SampledInRegion(region_bytes=short)
        return request.table, sample_in_region(table, request, self._lease(table, request),
                                               ring, layout)

    @staticmethod
    def _lease(table: Table, request: pb.SampleRequest) -> LeaseRequest | None:
        """The sample's lease (its acknowledgements applied first), or ``None``."""
        if not table.config.sampler.traits.consumes:
            return None  # nothing is leased: nothing to acknowledge
        if request.acknowledge:
            table.settle_leases(acknowledge=request.acknowledge)
        if not request.lease:
            return None
        return LeaseRequest(request.lease, table.config.effective_lease_timeout_s)

    async def acknowledge(self, raw: bytes, context: grpc.aio.ServicerContext,
                          _: Reservation) -> bytes:
        return await self.calls.run(context, self._acknowledge, raw)

    def _acknowledge(self, raw: bytes) -> bytes:
        request = _parse(pb.AcknowledgeRequest, raw)
        self._tables[request.table].settle_leases(acknowledge=request.leases)
        return pb.AcknowledgeResponse().SerializeToString()

    async def expire_leases_every(self, interval_s: float) -> None:
        """Return the rows of expired leases to their queues every ``interval_s`` (so calls
        waiting for rows wake without a sample to notice); runs until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            for table in self._tables:
                if table.config.sampler.traits.consumes:
                    back = await loop.run_in_executor(self.calls.executor, table.settle_leases)
                    if back:
                        self.calls.blocked.changed(table.name)

    async def sample_chunks(self, raw: bytes, context: grpc.aio.ServicerContext,
                            reservation: Reservation) -> AsyncIterator[bytes]:
        """SampleChunks: one batch as messages of whole rows under the message limit."""
        messages = await self.calls.change(context, self._sample, raw, reservation, True)
        for message in messages:
            yield message

    async def sample_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
        reservation: Reservation,
    ) -> AsyncIterator[bytes]:
        call = SampleStreamCall(self.calls, self._tables, self._stream_limits, requests, context,
                                owner=reservation)
        self._streams.add(call)
        chunks = call.run()
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            try:
                await chunks.aclose()  # the call's end (its ring unlinked) runs now, not later
            finally:
                self._streams.discard(call)

    def _wake_streams(self) -> None:
        """Draining started: streams waiting for their learner's credit end now."""
        for call in self._streams.copy():
            call.wake()

    def stream_transports(self) -> dict[str, int]:
        """Open SampleStream calls by transport (``grpc``, ``shared_memory``); any thread."""
        counts: dict[str, int] = {}
        for call in self._streams.copy():
            counts[call.transport] = counts.get(call.transport, 0) + 1
        return counts

    async def update_priorities(self, raw: bytes, context: grpc.aio.ServicerContext,
                                reservation: Reservation) -> bytes:
        return await self.calls.change(context, self._update_priorities, raw, reservation)

    def _update_priorities(self, raw: bytes, reservation: Reservation) -> tuple[str, bytes]:
        # The request, and as much again for its ids' positions and masks.
        reservation.resize(2 * len(raw), "UpdatePriorities")
        name, ids, priorities = messages.decode_update(raw)
        return name, self._apply_update(name, ids, priorities).SerializeToString()

    def _stream_update(
        self, request: pb.UpdatePrioritiesRequest
    ) -> tuple[str, pb.UpdatePrioritiesResponse]:
        ids, priorities = messages.update_arrays(request)
        return request.table, self._apply_update(request.table, ids, priorities)

    def _stream_update_now(self, request: pb.UpdatePrioritiesRequest) -> UpdatedNow | None:
        """A small update applied on the event loop if its table's lock is free (else
        ``None``); a table that logs its changes hands back what the answer waits for."""
        if request.count > INLINE_MAX_IDS:
            return None
        ids, priorities = messages.update_arrays(request)
        logged = _LoggedFuture()
        done = self._tables[request.table].update_priorities_now_durable(ids, priorities, logged)
        if done is None:
            return None
        applied, waits = done
        return (pb.UpdatePrioritiesResponse(applied=applied, stale=ids.size - applied),
                logged.future if waits else None)

    def _apply_update(self, name: str, ids: Any, priorities: Any) -> pb.UpdatePrioritiesResponse:
        applied = self._tables[name].update_priorities(ids, priorities)
        assert applied is not None
        return pb.UpdatePrioritiesResponse(applied=applied, stale=ids.size - applied)

    async def info(self, raw: bytes, context: grpc.aio.ServicerContext, _: Reservation) -> bytes:
        blocked = self.calls.blocked
        waiting = {
            table.name: (blocked.waiting(table.name, "insert"), blocked.waiting(table.name, "sample"))
            for table in self._tables
        }
        return await self.calls.run(context, self._info, waiting)

    def _info(self, waiting: dict[str, tuple[int, int]]) -> bytes:
        tables = []
        for table in self._tables:
            info = table.info()
            limiter = info.rate_limiter
            assert limiter is not None
            blocked_inserts, blocked_samples = waiting.get(table.name, (0, 0))
            tables.append(pb.TableInfo(
                name=info.name,
                sampler=info.sampler,
                capacity=info.capacity,
                size=info.size,
                schema=info.schema or {},
                pinned=info.pinned,
                storage_bytes=info.storage_bytes,
                pinned_bytes=info.pinned_bytes,
                counters=pb.TableCounters(**field_values(info.counters)),
                sampler_stats={k: float(v) for k, v in info.sampler_stats.items()},
                alpha=info.sampler_stats.get("alpha", info.config["alpha"]),  # in force now
                beta=info.sampler_stats.get("beta", info.config["beta"]),
                slice_len=info.config["slice_len"] or 0,
                rate_limiter=pb.RateLimiterInfo(
                    **field_values(limiter), blocked_inserts=blocked_inserts,
                    blocked_samples=blocked_samples,
                ),
                max_times_sampled=info.config["max_times_sampled"],
                mass=None if info.mass is None else info.mass.to_proto(),
                episode_key=info.config["episode_key"],
                capabilities=info.capabilities.to_proto(),
                id_segments=[pb.IdSegment(incarnation=i, first_position=f)
                             for i, f in info.id_segments],
            ))
        response = pb.InfoResponse(tables=tables, shard=self._incarnations.shard,
                                   incarnation=self._incarnations.current,
                                   limits=self._limits_info())
        response.server.CopyFrom(self._server_info)
        response.server.rss_bytes = rss_bytes()
        response.server.uptime_seconds = time.monotonic() - self._started
        last = None if self._checkpointer is None else self._checkpointer.last
        if last is not None:
            response.last_checkpoint.CopyFrom(_checkpoint_response(last))
        return response.SerializeToString()

    async def reset(self, raw: bytes, context: grpc.aio.ServicerContext, _: Reservation) -> bytes:
        return await self.calls.change(context, self._reset, raw)

    def _reset(self, raw: bytes) -> tuple[str, bytes]:
        request = _parse(pb.ResetRequest, raw)
        self._tables[request.table].reset(schema=request.schema)
        return request.table, pb.ResetResponse().SerializeToString()

    async def delete(self, raw: bytes, context: grpc.aio.ServicerContext, _: Reservation) -> bytes:
        return await self.calls.change(context, self._delete, raw)

    def _delete(self, raw: bytes) -> tuple[str, bytes]:
        request = _parse(pb.DeleteRequest, raw)
        ids = np.fromiter(request.ids, dtype=np.int64, count=len(request.ids))
        deleted = self._tables[request.table].delete(ids)
        return request.table, pb.DeleteResponse(
            deleted=deleted, stale=ids.size - deleted).SerializeToString()

    async def checkpoint(self, raw: bytes, context: grpc.aio.ServicerContext,
                         _: Reservation) -> bytes:
        return await self.calls.run(context, self._checkpoint, raw,
                                    executor=self._checkpoint_executor)

    def _checkpoint(self, raw: bytes) -> bytes:
        _parse(pb.CheckpointRequest, raw)
        if self._checkpointer is None:
            raise CheckpointsDisabledError(
                "this server has no checkpoint directory: set server.checkpoint_dir in its "
                "config to enable checkpoints")
        result = self._checkpointer.checkpoint(self._tables, "Checkpoint RPC",
                                               variables=self.variables.store)
        if result.failed:
            raise CheckpointPartError(f"checkpoint {partial_message(result)}")
        return _checkpoint_response(result).SerializeToString()

    # ---------------------------------------------------------------- helpers

    def _check_unary_size(self, table: Table, batch_size: int, chunks: bool = False,
                          message: bool = True) -> int:
        """The bytes of a batch of ``batch_size``, refused if over the message (one message,
        or with ``chunks`` one row; ``message=False``: no message carries it) or batch
        limit."""
        # An invalid batch_size is the table's to refuse (INVALID_ARGUMENT), not a size problem.
        estimate = table.batch_nbytes(batch_size) if 1 <= batch_size <= MAX_BATCH_SIZE else 0
        row = table.batch_nbytes(1) if estimate else 0
        if message and chunks and row > chunk_bytes(self._max_message):
            raise LimitExceededError(
                f"table {table.name!r}: one row (or slice) of a sample is about {row >> 10} KiB, "
                f"over the {self._max_message >> 20} MiB message limit less its header; raise "
                f"server.max_message_mb (and the client's max_message_mb)")
        if message and not chunks and estimate > self._max_message - HEADROOM:
            raise MessageTooLargeError(
                f"table {table.name!r}: a batch of {batch_size} is about {estimate >> 20} MiB, "
                f"over the {self._max_message >> 20} MiB message limit: sample it with "
                f"SampleChunks (ReplayClient.sample does by itself) or SampleStream"
            )
        limit = self._stream_limits.max_batch_bytes
        if estimate > limit:
            raise LimitExceededError(
                f"table {table.name!r}: a batch of {batch_size} is about {estimate >> 20} MiB, "
                f"over server.max_batch_mb = {limit >> 20}; ask for a smaller batch_size")
        return estimate

    def _limits_info(self) -> pb.ServerLimits:
        limits, budget = self._admission.limits, self._admission.budget
        connections_open, connections_closed = self.connection_figures()
        rings = self._stream_limits.shared_memory_budget
        memory = self._tables.memory
        return pb.ServerLimits(
            memory_budget_bytes=limits.memory_budget_bytes, memory_in_use_bytes=budget.in_use,
            memory_peak_bytes=budget.peak, max_concurrent_calls=limits.max_concurrent_calls,
            calls_in_flight=self._admission.in_flight, max_connections=limits.max_connections,
            idle_timeout_s=limits.idle_timeout_s, max_batch_bytes=limits.max_batch_bytes,
            max_message_bytes=limits.max_message_bytes,
            shared_memory_bytes=limits.shared_memory_bytes,
            shared_memory_in_use_bytes=rings.in_use, table_memory_bytes=memory.limit,
            table_memory_committed_bytes=memory.committed,
            refused_calls=budget.refused + self._admission.refused,
            max_waiting_calls=limits.max_waiting_calls, calls_waiting=self._admission.waiting,
            default_wait_s=limits.default_wait_s, handshake_timeout_s=limits.handshake_timeout_s,
            max_idle_connections_per_host=limits.max_idle_connections_per_host,
            connections_open=connections_open, connections_closed=connections_closed,
            max_streams=limits.max_streams, streams_open=self._admission.streams,
            transport_bound_bytes=limits.transport_bound_bytes,
            keepalive_s=limits.keepalive_s, keepalive_timeout_s=limits.keepalive_timeout_s,
            memory_waiting_calls=budget.waiting, memory_wait_s=limits.memory_wait_s,
            max_host_share=limits.max_host_share,
            refused_calls_host_share=self._admission.shares.refused,
        )

    def _may_pass(self, table: str, operation: str, count: int) -> bool:
        """Lock-free hint for blocked calls: might a held-back call pass now?"""
        found = self._tables[table]
        limiter = found.rate_limiter
        if operation == "insert":
            return limiter.can_insert(1) and found.may_insert(count)
        return limiter.can_sample(1) and found.size > 0


def _inserted(ids: Any) -> pb.InsertResponse:
    """The InsertResponse naming ``ids`` (consecutive)."""
    return pb.InsertResponse(first_id=int(ids[0]) if len(ids) else 0, count=len(ids))


def _checkpoint_response(result: CheckpointResult) -> pb.CheckpointResponse:
    return pb.CheckpointResponse(
        path=str(result.path), sequence=result.sequence, created=result.created,
        bytes=result.nbytes, seconds=result.seconds, table_rows=result.tables,
    )


def _parse(message_type: Any, raw: bytes) -> Any:  # a generated message class
    try:
        return message_type.FromString(raw)
    except Exception as exc:
        raise CodecError(f"malformed {message_type.__name__}: {exc}") from None


class _LoggedFuture:
    """A future on the running event loop that a table settles, from any thread, once an
    insert is durable (``self(None)``) or with the error to answer (``self(error)``)."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._thread = threading.get_ident()

    def __call__(self, error: BaseException | None) -> None:
        if threading.get_ident() == self._thread:  # told at once, on the loop
            _settle(self.future, error)
            return
        try:
            self.future.get_loop().call_soon_threadsafe(_settle, self.future, error)
        except RuntimeError:
            pass  # the loop has closed: no one waits for the answer


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return  # the call was cancelled meanwhile
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
