"""``replay.v1.ReplayService`` handlers: decode, call the engine, encode.

Handlers receive and return raw message bytes (so tensor payloads are never
copied through protobuf fields; see :mod:`replay_proto.codec`). Engine work,
decoding included, runs in a bounded thread pool, never on the event loop.
Calls a table's rate limiter holds back wait in
:mod:`replay_server.service.waiting`, holding no thread; every call that
changes a table reports it there.
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
from replay_server.errors import CheckpointsDisabledError
from replay_server.service.status import (
    ERROR_KIND_KEY,
    MessageTooLargeError,
    ShuttingDownError,
    status_of,
)
from replay_server.service.streaming import HEADROOM, SampleStreamCall, estimated_bytes
from replay_server.service.waiting import BlockedCalls
from replay_server.tables import Tables

log = logging.getLogger("replay_server.service")

SERVICE_NAME = "replay.v1.ReplayService"

T = TypeVar("T")


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
        self, tables: Tables, executor: Executor, max_message_bytes: int, *,
        shared_memory: bool = True, checkpointer: Checkpointer | None = None,
        checkpoint_executor: Executor | None = None,
    ) -> None:
        self._tables = tables
        self._executor = executor
        self._max_message = max_message_bytes
        self.shared_memory = shared_memory
        self._checkpointer = checkpointer
        self._checkpoint_executor = checkpoint_executor or executor
        self._draining = False
        self._blocked = BlockedCalls(self._may_pass)
        self.restoring = False  # tables are being restored: calls are refused (UNAVAILABLE)

    @property
    def draining(self) -> bool:
        """Set when the server starts draining: new calls are refused, waiting ones give up."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:
            self._blocked.changed()

    def tables_changed(self, table: str | None = None) -> None:
        """Wake calls waiting on ``table`` (``None``: all tables; e.g. after a restore).

        Event-loop only.
        """
        self._blocked.changed(table)

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
                "SampleStream": grpc.stream_stream_rpc_method_handler(self.sample_stream),
                "UpdatePriorities": unary(self.update_priorities),
                "Info": unary(self.info),
                "Reset": unary(self.reset),
                "Checkpoint": unary(self.checkpoint),
            },
        )

    # ---------------------------------------------------------------- handlers

    async def insert(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._change(context, self._insert, raw)

    def _insert(self, raw: bytes) -> tuple[str, bytes]:
        call = messages.decode_insert(raw)
        ids = self._tables[call.table].insert(call.columns, call.priorities)
        return call.table, messages.encode_insert_response(int(ids[0]) if len(ids) else 0, len(ids))

    async def sample(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._change(context, self._sample, raw)

    def _sample(self, raw: bytes) -> tuple[str, bytes]:
        request = _parse(pb.SampleRequest, raw)
        table = self._tables[request.table]
        self._check_unary_size(table, request.batch_size)
        batch = table.sample(request.batch_size)
        return request.table, messages.encode_sample(batch, 0, self._max_message)[0]

    async def sample_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for chunk in SampleStreamCall(self, requests, context).run():
            yield chunk

    async def update_priorities(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._change(context, self._update_priorities, raw)

    def _update_priorities(self, raw: bytes) -> tuple[str, bytes]:
        name, ids, priorities = messages.decode_update(raw)
        applied = self._tables[name].update_priorities(ids, priorities)
        response = pb.UpdatePrioritiesResponse(applied=applied, stale=len(ids) - applied)
        return name, response.SerializeToString()

    async def info(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        waiting = {
            table.name: (self._blocked.waiting(table.name, "insert"),
                         self._blocked.waiting(table.name, "sample"))
            for table in self._tables
        }
        return await self._run(context, self._info, waiting)

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
        return await self._change(context, self._reset, raw)

    def _reset(self, raw: bytes) -> tuple[str, bytes]:
        name = _parse(pb.ResetRequest, raw).table
        self._tables[name].reset()
        return name, pb.ResetResponse().SerializeToString()

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
        estimate = estimated_bytes(table, batch_size)
        if estimate > self._max_message - HEADROOM:
            raise MessageTooLargeError(
                f"table {table.name!r}: a batch of {batch_size} is about {estimate >> 20} MiB, "
                f"over the {self._max_message >> 20} MiB message limit; use SampleStream "
                f"(client.stream), which splits batches, or a smaller batch_size"
            )

    def _may_pass(self, table: str, operation: str, count: int) -> bool:
        """Lock-free hint for :class:`BlockedCalls`: might a held-back call pass now?"""
        limiter = self._tables[table].rate_limiter
        return limiter.can_insert(1) if operation == "insert" else limiter.can_sample(1)

    def _refusal(self) -> ShuttingDownError | None:
        """Why new work is refused now (UNAVAILABLE): draining, or still restoring at start."""
        if self.draining:
            return ShuttingDownError("the server is shutting down")
        if self.restoring:
            return ShuttingDownError(
                "the server is restoring its tables from a checkpoint; try again shortly")
        return None

    async def _change(
        self,
        context: grpc.aio.ServicerContext,
        fn: Callable[..., tuple[str, T]],
        *args: Any,
        aborting: bool = True,
    ) -> T:
        """Run ``fn`` (which returns ``(table, result)``) in the pool, waiting while it is
        rate-limited; then report the table changed and return ``result``.

        Errors abort the call with their status, or propagate (``aborting=False``).
        """
        refused = self._refusal()
        if refused is not None:
            if aborting:
                await self._abort(context, refused)
            raise refused
        loop = asyncio.get_running_loop()
        work = self._blocked.run(
            lambda: loop.run_in_executor(self._executor, fn, *args),
            time_remaining=context.time_remaining,
            stopping=lambda: self.draining,
        )
        table, result = await (self._await(context, work) if aborting else work)
        self._blocked.changed(table)
        return result

    async def _run(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any,
        executor: Executor | None = None,
    ) -> T:
        refused = self._refusal()
        if refused is not None:
            await self._abort(context, refused)
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
