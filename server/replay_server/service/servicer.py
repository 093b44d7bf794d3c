"""``replay.v1.ReplayService`` handlers: decode, call the engine, encode.

Handlers receive and return raw message bytes (so tensor payloads are never
copied through protobuf fields; see :mod:`replay_proto.codec`). Engine work,
decoding included, runs in a bounded thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import asdict
from typing import Any, TypeVar

import grpc

from replay_proto import messages
from replay_proto.codec import CodecError
from replay_proto.v1 import replay_pb2 as pb
from replay_server.checkpoint import Checkpointer, CheckpointResult
from replay_server.errors import CheckpointsDisabledError, InvalidArgumentError
from replay_server.service.status import (
    ERROR_KIND_KEY,
    MessageTooLargeError,
    ShuttingDownError,
    status_of,
)
from replay_server.table import MAX_BATCH_SIZE
from replay_server.tables import Tables

log = logging.getLogger("replay_server.service")

SERVICE_NAME = "replay.v1.ReplayService"
_HEADROOM = 64 * 1024  # bytes kept free for the header in a chunk
_STREAM_CHUNK = 4 * 1024 * 1024  # Python gRPC moves 1-4 MB messages fastest

T = TypeVar("T")


class ReplayServicer:
    """The service's handlers over a set of tables.

    Args:
        tables: the engine's tables.
        executor: where engine work runs (bounded thread pool).
        max_message_bytes: the gRPC message-size limit, both ways.
        checkpointer: writes checkpoints (``None``: the server has no checkpoint_dir).
        checkpoint_executor: where checkpoint calls wait and run (not the engine's pool).
    """

    def __init__(
        self, tables: Tables, executor: Executor, max_message_bytes: int, *,
        checkpointer: Checkpointer | None = None, checkpoint_executor: Executor | None = None,
    ) -> None:
        self._tables = tables
        self._executor = executor
        self._max_message = max_message_bytes
        self._checkpointer = checkpointer
        self._checkpoint_executor = checkpoint_executor or executor
        self.draining = False
        self.restoring = False  # tables are being restored: calls are refused (UNAVAILABLE)

    def use_tables(self, tables: Tables) -> None:
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
                "SampleStream": grpc.unary_stream_rpc_method_handler(self.sample_stream),
                "UpdatePriorities": unary(self.update_priorities),
                "Info": unary(self.info),
                "Reset": unary(self.reset),
                "Checkpoint": unary(self.checkpoint),
            },
        )

    # ---------------------------------------------------------------- handlers

    async def insert(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._insert, raw)

    def _insert(self, raw: bytes) -> bytes:
        call = messages.decode_insert(raw)
        ids = self._tables[call.table].insert(call.columns, call.priorities)
        return messages.encode_insert_response(int(ids[0]) if len(ids) else 0, len(ids))

    async def sample(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._sample, raw)

    def _sample(self, raw: bytes) -> bytes:
        request = _parse(pb.SampleRequest, raw)
        table = self._tables[request.table]
        self._check_unary_size(table, request.batch_size)
        return messages.encode_sample(table.sample(request.batch_size), 0, self._max_message)[0]

    async def sample_stream(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        request = await self._run(context, _parse, pb.SampleRequest, raw)
        for name in ("num_batches", "batches_per_message"):
            if getattr(request, name) < 0:
                await self._abort(context, InvalidArgumentError(
                    f"{name} must be >= 0, got {getattr(request, name)}"))
        loop = asyncio.get_running_loop()
        index = 0
        pending = self._draw_group(loop, request, index)
        while pending is not None:
            if self.draining:
                pending.cancel()
                await self._abort(context, ShuttingDownError("the server is shutting down"))
            chunks, count = await self._await(context, pending)
            index += count
            # Draw the next group while this one is being sent.
            pending = self._draw_group(loop, request, index)
            for chunk in chunks:
                yield chunk

    def _draw_group(
        self, loop: asyncio.AbstractEventLoop, request: pb.SampleRequest, index: int
    ) -> asyncio.Future | None:
        """Start drawing the group of batches that begins at batch ``index`` (None: done)."""
        count = max(1, request.batches_per_message)
        if request.num_batches:
            count = min(count, request.num_batches - index)
            if count <= 0:
                return None
        return loop.run_in_executor(self._executor, self._stream_group, request, index, count)

    def _stream_group(
        self, request: pb.SampleRequest, index: int, count: int
    ) -> tuple[list[bytes], int]:
        table = self._tables[request.table]
        batch_bytes = _estimated_bytes(table, request.batch_size)
        if batch_bytes:
            count = max(1, min(count, _STREAM_CHUNK // batch_bytes))
        if count > 1 and request.batch_size * count > MAX_BATCH_SIZE:
            count = 1
        batch = table.sample(request.batch_size * count)
        chunk_bytes = max(1, min(_STREAM_CHUNK, self._max_message - _HEADROOM))
        return messages.encode_sample(batch, index, chunk_bytes, batch_count=count), count

    async def update_priorities(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._update_priorities, raw)

    def _update_priorities(self, raw: bytes) -> bytes:
        name, ids, priorities = messages.decode_update(raw)
        applied = self._tables[name].update_priorities(ids, priorities)
        return pb.UpdatePrioritiesResponse(applied=applied, stale=len(ids) - applied).SerializeToString()

    async def info(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._info)

    def _info(self) -> bytes:
        tables = []
        for table in self._tables:
            info = table.info()
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
            ))
        response = pb.InfoResponse(tables=tables)
        last = None if self._checkpointer is None else self._checkpointer.last
        if last is not None:
            response.last_checkpoint.CopyFrom(_checkpoint_response(last))
        return response.SerializeToString()

    async def reset(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._reset, raw)

    def _reset(self, raw: bytes) -> bytes:
        self._tables[_parse(pb.ResetRequest, raw).table].reset()
        return pb.ResetResponse().SerializeToString()

    async def checkpoint(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._checkpoint, raw, executor=self._checkpoint_executor)

    def _checkpoint(self, raw: bytes) -> bytes:
        _parse(pb.CheckpointRequest, raw)
        if self._checkpointer is None:
            raise CheckpointsDisabledError(
                "this server has no checkpoint directory: set server.checkpoint_dir in its "
                "config to enable checkpoints")
        result = self._checkpointer.checkpoint(self._tables, "Checkpoint RPC")
        return _checkpoint_response(result).SerializeToString()

    # ---------------------------------------------------------------- helpers

    def _check_unary_size(self, table: Any, batch_size: int) -> None:
        estimate = _estimated_bytes(table, batch_size)
        if estimate > self._max_message - _HEADROOM:
            raise MessageTooLargeError(
                f"table {table.name!r}: a batch of {batch_size} is about {estimate >> 20} MiB, "
                f"over the {self._max_message >> 20} MiB message limit; use SampleStream "
                f"(client.stream), which splits batches, or a smaller batch_size"
            )

    async def _run(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any,
        executor: Executor | None = None,
    ) -> T:
        if self.draining:
            await self._abort(context, ShuttingDownError("the server is shutting down"))
        if self.restoring:
            await self._abort(context, ShuttingDownError(
                "the server is restoring its tables from a checkpoint; try again shortly"))
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(executor or self._executor, fn, *args)
        return await self._await(context, future)

    async def _await(self, context: grpc.aio.ServicerContext, future: Awaitable[T]) -> T:
        """The result of engine work, with its errors turned into the RPC's status."""
        try:
            return await future
        except Exception as exc:
            await self._abort(context, exc)
            raise  # unreachable: abort raises

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        mapped = status_of(exc)
        if mapped is None:
            log.error("internal error while serving a request", exc_info=exc)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                "internal server error (the server logged the details)",
                trailing_metadata=((ERROR_KIND_KEY, "internal"),),
            )
        code, kind = mapped
        await context.abort(code, str(exc), trailing_metadata=((ERROR_KIND_KEY, kind),))


def _estimated_bytes(table: Any, batch_size: int) -> int:
    """About how many bytes a batch of ``batch_size`` takes on the wire (0: unknown or invalid)."""
    schema = table.schema
    if schema is None or not 1 <= batch_size <= MAX_BATCH_SIZE:
        return 0  # nothing to send yet, or the engine refuses the batch size itself
    steps = table.config.slice_len or 1
    return batch_size * (steps * (schema.row_bytes + 8) + 4 + 8)


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
