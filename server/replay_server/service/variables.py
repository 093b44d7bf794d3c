"""``Publish`` and ``Fetch``: named variables over gRPC, and fetches that wait for a newer version.

Publishing decodes and copies the tensors in the engine's pool (never on the
event loop), stores them in the :class:`~replay_server.engine.variables.VariableStore`,
then wakes the fetches waiting on that name. A fetch with ``newer_than``
that finds nothing newer waits on an event of its name, on the event loop,
holding no thread and polling nothing, until a publish wakes it, its
``timeout_s`` passes (answered ``found = false``), shortly before its gRPC
deadline (the same: so the answer reaches the client in time; without a
deadline, ``server.default_wait_s``), or the server drains (UNAVAILABLE).
While it waits it counts in the waiting calls' pool, not the working one
(:mod:`~replay_server.service.admission`).

Thread-safety: event-loop only (the engine work runs in the pool).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from replay_proto import variable_codec
from replay_proto.chunks import CHUNK_HEADROOM, chunk_bytes, frame_chunks
from replay_proto.codec import CodecError
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import Variable, VariableStore, check_name
from replay_server.errors import InvalidVariableError
from replay_server.service.budget import Reservation
from replay_server.service.calls import CallRunner
from replay_server.service.status import MessageTooLargeError, OverloadedError, ShuttingDownError
from replay_server.service.waiting import GIVE_UP_EARLY_FRACTION, GIVE_UP_EARLY_MAX_S


class VariableService:
    """The Publish and Fetch handlers over one variable store.

    Args:
        store: the server's variables.
        calls: runs engine work; its ``draining`` ends waiting fetches.
        max_message_bytes: the message limit; a larger answer goes by ``FetchChunks``.
    """

    def __init__(self, store: VariableStore, calls: CallRunner,
                 max_message_bytes: int = 1 << 31) -> None:
        self.store = store
        self._max_message = max_message_bytes
        self._calls = calls
        self._published: dict[str, asyncio.Event] = {}
        calls.on_drain.append(self._wake_all)

    def use_store(self, store: VariableStore) -> None:
        """Serve ``store`` from now on (the restored one, before SERVING)."""
        self.store = store

    async def publish(self, raw: bytes, context: grpc.aio.ServicerContext,
                      reservation: Reservation) -> bytes:
        """Publish (the reservation holds the request while it is decoded and stored)."""
        variable = await self._calls.run(context, self._publish, raw)
        event = self._published.pop(variable.name, None)
        if event is not None:
            event.set()
        return pb.PublishResponse(version=variable.version,
                                  bytes=self.store.nbytes).SerializeToString()

    def _publish(self, raw: bytes) -> Variable:
        try:
            name, specs, payload = variable_codec.decode_publish_packed(raw)
        except variable_codec.VariableFormatError as exc:
            raise InvalidVariableError(f"variable: {exc}") from None
        return self.store.publish_packed(name, specs, payload)

    async def fetch(self, raw: bytes, context: grpc.aio.ServicerContext,
                    reservation: Reservation) -> bytes:
        """Fetch; the answer's bytes are reserved until the client has taken them."""
        answer = await self._fetch(raw, context)
        try:
            reservation.resize(len(raw) + len(answer), f"Fetch: an answer of {len(answer)} bytes")
        except Exception as exc:  # over the memory budget: refused with its status
            await self._calls.fail(context, exc)
        return answer

    async def fetch_chunks(self, raw: bytes, context: grpc.aio.ServicerContext,
                           reservation: Reservation) -> AsyncIterator[bytes]:
        """FetchChunks: the answer as one message, or chunked when over the message limit
        (the answer and its chunks are reserved until the client has taken them)."""
        messages = await self._fetch(raw, context, chunk_bytes(self._max_message))
        try:
            reservation.resize(len(raw) + sum(map(len, messages)),
                               f"FetchChunks: an answer of {sum(map(len, messages))} bytes")
        except Exception as exc:  # over the memory budget: refused with its status
            await self._calls.fail(context, exc)
        for message in messages:
            yield message

    async def _fetch(self, raw: bytes, context: grpc.aio.ServicerContext,
                     chunk: int | None = None) -> Any:
        """The answer: one message, or (``chunk``) the list of FetchChunks' messages."""
        request = await self._calls.run(context, _parse_fetch, raw)
        if not request.HasField("newer_than"):
            return await self._calls.run(context, self._encode, request.name, chunk)
        check = await self._calls.run(context, check_name, request.name)  # refuse bad names now
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + request.timeout_s
        remaining = self._calls.deadline_or_default(context)()
        if remaining is not None:  # answer before the client's own deadline fires
            early = min(GIVE_UP_EARLY_MAX_S, GIVE_UP_EARLY_FRACTION * remaining)
            give_up_at = min(give_up_at, loop.time() + remaining - early)
        waiting = False
        while True:
            if self._calls.draining:
                await self._calls.fail(context, ShuttingDownError("the server is shutting down"))
            if self.store.version(check) > request.newer_than:
                return await self._calls.run(context, self._encode, check, chunk)
            left = give_up_at - loop.time()
            if left <= 0:
                answer = variable_codec.encode_not_newer(check)
                return answer if chunk is None else [answer]
            if not waiting:
                waiting = True
                try:
                    self._calls.start_waiting(context)  # out of the working calls' pool
                except OverloadedError as exc:
                    await self._calls.fail(context, exc)
            event = self._published.setdefault(check, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), None if math.isinf(left) else left)
            except TimeoutError:
                pass

    def _encode(self, name: str, chunk: int | None = None) -> Any:
        variable = self.store.get(name)
        head = pb.FetchResponse(found=True, name=variable.name, version=variable.version)
        nbytes = head.ByteSize() + len(variable.layout) + variable.data.nbytes + 16
        if chunk is None or nbytes < chunk:
            if chunk is None and nbytes > self._max_message - CHUNK_HEADROOM:
                raise MessageTooLargeError(
                    f"variable {name[:200]!r} is {nbytes / 2**20:.1f} MiB, over the "
                    f"{self._max_message >> 20} MiB message limit: fetch it with FetchChunks "
                    f"(ReplayClient.fetch does by itself)")
            answer = variable_codec.encode_fetch_packed(variable.name, variable.version,
                                                        variable.layout, variable.data)
            return answer if chunk is None else [answer]
        header, buffers = variable_codec.fetch_packed_parts(variable.name, variable.version,
                                                            variable.layout, variable.data)
        return frame_chunks(header, buffers, chunk)

    def _wake_all(self) -> None:
        events, self._published = list(self._published.values()), {}
        for event in events:
            event.set()


def _parse_fetch(raw: bytes) -> pb.FetchRequest:
    try:
        request = pb.FetchRequest.FromString(raw)
    except Exception as exc:
        raise CodecError(f"malformed FetchRequest: {exc}") from None
    if request.HasField("newer_than") and (
            request.newer_than < 0 or math.isnan(request.timeout_s) or request.timeout_s < 0):
        raise CodecError(
            f"FetchRequest: newer_than must be >= 0 and timeout_s >= 0, got "
            f"{request.newer_than} and {request.timeout_s}")
    return request
