"""``replay.v1.ReplayService`` handlers: decode, call the engine, encode.

Handlers receive and return raw message bytes (so tensor payloads are never
copied through protobuf fields; see :mod:`replay_proto.codec`). Engine work,
decoding included, runs through a :class:`~replay_server.service.calls.CallRunner`:
in a bounded thread pool, never on the event loop, waiting without a thread
while a table's rate limiter holds it back. ``SampleStream`` and
``UpdateStream`` are handlers of their own
(:mod:`replay_server.service.sample_stream`,
:mod:`replay_server.service.update_stream`, which applies small priority
updates on the event loop when their table is free), sharing the runner.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import asdict
from typing import Any

import grpc

from replay_proto import messages
from replay_proto.codec import CodecError
from replay_proto.sample_codec import HEADROOM, encode_sample
from replay_proto.v1 import replay_pb2 as pb
from replay_server.checkpoint import Checkpointer, CheckpointResult
from replay_server.engine.inputs import MAX_BATCH_SIZE
from replay_server.engine.table import Table
from replay_server.engine.table_set import TableSet
from replay_server.errors import CheckpointsDisabledError
from replay_server.service.calls import CallRunner
from replay_server.service.sample_stream import SampleStreamCall, StreamLimits
from replay_server.service.status import MessageTooLargeError
from replay_server.service.update_stream import INLINE_MAX_IDS, UpdateStreamHandler

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
    """

    def __init__(
        self, tables: TableSet, executor: Executor, max_message_bytes: int, *,
        shared_memory: bool = True, checkpointer: Checkpointer | None = None,
        checkpoint_executor: Executor | None = None,
    ) -> None:
        self._tables = tables
        self._max_message = max_message_bytes
        self._stream_limits = StreamLimits(max_message_bytes=max_message_bytes,
                                           shared_memory=shared_memory)
        self._checkpointer = checkpointer
        self._checkpoint_executor = checkpoint_executor or executor
        self.calls = CallRunner(executor, self._may_pass)
        """Runs every call's engine work; the server sets its ``draining``/``restoring``."""
        self._update_stream = UpdateStreamHandler(self.calls, self._stream_update,
                                                  self._stream_update_now)

    def use_tables(self, tables: TableSet) -> None:
        """Serve ``tables`` from now on (the restored ones, before SERVING)."""
        self._tables = tables

    def handler(self) -> grpc.GenericRpcHandler:
        """A generic handler serving every RPC of ``replay.v1.ReplayService``."""
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Insert": unary(self.insert),
                "Sample": unary(self.sample),
                "SampleStream": grpc.stream_stream_rpc_method_handler(self.sample_stream),
                "UpdatePriorities": unary(self.update_priorities),
                "Info": unary(self.info),
                "Reset": unary(self.reset),
                "Checkpoint": unary(self.checkpoint),
                "UpdateStream": grpc.stream_stream_rpc_method_handler(self._update_stream.serve),
            },
        )

    # ---------------------------------------------------------------- handlers

    async def insert(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self.calls.change(context, self._insert, raw)

    def _insert(self, raw: bytes) -> tuple[str, bytes]:
        call = messages.decode_insert(raw)
        ids = self._tables[call.table].insert(call.columns, call.priorities)
        return call.table, messages.encode_insert_response(int(ids[0]) if len(ids) else 0, len(ids))

    async def sample(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self.calls.change(context, self._sample, raw)

    def _sample(self, raw: bytes) -> tuple[str, bytes]:
        request = _parse(pb.SampleRequest, raw)
        table = self._tables[request.table]
        self._check_unary_size(table, request.batch_size)
        batch = table.sample(request.batch_size)
        return request.table, encode_sample(batch, 0, self._max_message)[0]

    async def sample_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        call = SampleStreamCall(self.calls, self._tables, self._stream_limits, requests, context)
        async for chunk in call.run():
            yield chunk

    async def update_priorities(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self.calls.change(context, self._update_priorities, raw)

    def _update_priorities(self, raw: bytes) -> tuple[str, bytes]:
        name, ids, priorities = messages.decode_update(raw)
        return name, self._apply_update(name, ids, priorities).SerializeToString()

    def _stream_update(
        self, request: pb.UpdatePrioritiesRequest
    ) -> tuple[str, pb.UpdatePrioritiesResponse]:
        ids, priorities = messages.update_arrays(request)
        return request.table, self._apply_update(request.table, ids, priorities)

    def _stream_update_now(
        self, request: pb.UpdatePrioritiesRequest
    ) -> pb.UpdatePrioritiesResponse | None:
        """A small update applied on the event loop if its table's lock is free (else ``None``)."""
        if request.count > INLINE_MAX_IDS:
            return None
        ids, priorities = messages.update_arrays(request)
        applied = self._tables[request.table].update_priorities(ids, priorities, blocking=False)
        if applied is None:
            return None
        return pb.UpdatePrioritiesResponse(applied=applied, stale=len(ids) - applied)

    def _apply_update(self, name: str, ids: Any, priorities: Any) -> pb.UpdatePrioritiesResponse:
        applied = self._tables[name].update_priorities(ids, priorities)
        assert applied is not None
        return pb.UpdatePrioritiesResponse(applied=applied, stale=len(ids) - applied)

    async def info(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
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
                counters=pb.TableCounters(**asdict(info.counters)),
                sampler_stats={k: float(v) for k, v in info.sampler_stats.items()},
                alpha=info.config["alpha"],
                beta=info.config["beta"],
                slice_len=info.config["slice_len"] or 0,
                rate_limiter=pb.RateLimiterInfo(
                    **asdict(limiter), blocked_inserts=blocked_inserts,
                    blocked_samples=blocked_samples,
                ),
                max_times_sampled=info.config["max_times_sampled"],
            ))
        response = pb.InfoResponse(tables=tables)
        last = None if self._checkpointer is None else self._checkpointer.last
        if last is not None:
            response.last_checkpoint.CopyFrom(_checkpoint_response(last))
        return response.SerializeToString()

    async def reset(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self.calls.change(context, self._reset, raw)

    def _reset(self, raw: bytes) -> tuple[str, bytes]:
        name = _parse(pb.ResetRequest, raw).table
        self._tables[name].reset()
        return name, pb.ResetResponse().SerializeToString()

    async def checkpoint(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self.calls.run(context, self._checkpoint, raw,
                                    executor=self._checkpoint_executor)

    def _checkpoint(self, raw: bytes) -> bytes:
        _parse(pb.CheckpointRequest, raw)
        if self._checkpointer is None:
            raise CheckpointsDisabledError(
                "this server has no checkpoint directory: set server.checkpoint_dir in its "
                "config to enable checkpoints")
        result = self._checkpointer.checkpoint(self._tables, "Checkpoint RPC")
        return _checkpoint_response(result).SerializeToString()

    # ---------------------------------------------------------------- helpers

    def _check_unary_size(self, table: Table, batch_size: int) -> None:
        # An invalid batch_size is the table's to refuse (INVALID_ARGUMENT), not a size problem.
        estimate = table.batch_nbytes(batch_size) if 1 <= batch_size <= MAX_BATCH_SIZE else 0
        if estimate > self._max_message - HEADROOM:
            raise MessageTooLargeError(
                f"table {table.name!r}: a batch of {batch_size} is about {estimate >> 20} MiB, "
                f"over the {self._max_message >> 20} MiB message limit; use SampleStream "
                f"(client.stream), which splits batches, or a smaller batch_size"
            )

    def _may_pass(self, table: str, operation: str, count: int) -> bool:
        """Lock-free hint for blocked calls: might a held-back call pass now?"""
        limiter = self._tables[table].rate_limiter
        return limiter.can_insert(1) if operation == "insert" else limiter.can_sample(1)


def _checkpoint_response(result: CheckpointResult) -> pb.CheckpointResponse:
    return pb.CheckpointResponse(
        path=str(result.path), sequence=result.sequence, created=result.created,
        bytes=result.nbytes, seconds=result.seconds, table_rows=result.tables,
    )


def _parse(message_type: type, raw: bytes) -> Any:
    try:
        return message_type.FromString(raw)
    except Exception as exc:
        raise CodecError(f"malformed {message_type.__name__}: {exc}") from None
