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
from replay_server.errors import InvalidArgumentError
from replay_server.service.status import (
    ERROR_KIND_KEY,
    MessageTooLargeError,
    ShuttingDownError,
    status_of,
)
from replay_server.service.streaming import SampleStreamCall, _estimated_bytes
from replay_server.tables import Tables

log = logging.getLogger("replay_server.service")

SERVICE_NAME = "replay.v1.ReplayService"
_HEADROOM = 64 * 1024  # bytes kept free for the header in a chunk

T = TypeVar("T")


class ReplayServicer:
    """The service's handlers over a set of tables.

    Args:
        tables: the engine's tables.
        executor: where engine work runs (bounded thread pool).
        max_message_bytes: the gRPC message-size limit, both ways.
        shared_memory: offer same-host learners a shared-memory ring for streams.
    """

    def __init__(self, tables: Tables, executor: Executor, max_message_bytes: int,
                 shared_memory: bool = True) -> None:
        self._tables = tables
        self._executor = executor
        self._max_message = max_message_bytes
        self.shared_memory = shared_memory
        self.draining = False

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
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for chunk in SampleStreamCall(self, requests, context).run():
            yield chunk

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
        return pb.InfoResponse(tables=tables).SerializeToString()

    async def reset(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._run(context, self._reset, raw)

    def _reset(self, raw: bytes) -> bytes:
        self._tables[_parse(pb.ResetRequest, raw).table].reset()
        return pb.ResetResponse().SerializeToString()

    # ---------------------------------------------------------------- helpers

    def _check_unary_size(self, table: Any, batch_size: int) -> None:
        estimate = _estimated_bytes(table, batch_size)
        if estimate > self._max_message - _HEADROOM:
            raise MessageTooLargeError(
                f"table {table.name!r}: a batch of {batch_size} is about {estimate >> 20} MiB, "
                f"over the {self._max_message >> 20} MiB message limit; use SampleStream "
                f"(client.stream), which splits batches, or a smaller batch_size"
            )

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        if self.draining:
            await self._abort(context, ShuttingDownError("the server is shutting down"))
        loop = asyncio.get_running_loop()
        return await self._await(context, loop.run_in_executor(self._executor, fn, *args))

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


def _parse(message_type: type, raw: bytes) -> Any:
    try:
        return message_type.FromString(raw)
    except Exception as exc:
        raise CodecError(f"malformed {message_type.__name__}: {exc}") from None
