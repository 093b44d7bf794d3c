"""``SampleStream``: batches to a learner, flow-controlled by its credits, over gRPC or shared memory.

One :class:`SampleStreamCall` per call. The learner's first message names the
table and batch size and grants ``credits`` (its prefetch window); each later
message grants one credit per batch it took. The server draws batch ``k``
only once ``k < credits``, so it never runs more than the window ahead and
each batch sees every priority update made before it was drawn. While a
group is being sent the next is drawn, when credits allow.

Same host: if the learner asked for shared memory and runs on this host
(same boot id), the server creates a ring of ``credits + 1`` slots in
/dev/shm sized for one batch each and offers it with the first batch. Once
the learner accepts, batches are gathered straight from table storage into
the ring (no serialization, no copy through gRPC) and messages carry only
offsets. Batch ``k`` goes into slot ``k % slots``; the credit rule guarantees
the learner has given that slot back. The ring's name is unlinked as soon as
the learner answers, so nothing is left in /dev/shm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import torch

from replay_proto import messages
from replay_proto.batch import SampleBatch
from replay_proto.codec import spec_of
from replay_proto.keys import flatten
from replay_proto.shm import SharedMemoryError, SharedRing, align, host_id
from replay_proto.v1 import replay_pb2 as pb
from replay_server.errors import InvalidArgumentError, RateLimitedError
from replay_server.service.status import ShuttingDownError
from replay_server.table import MAX_BATCH_SIZE, Table

if TYPE_CHECKING:
    from replay_server.service.servicer import ReplayServicer

log = logging.getLogger("replay_server.service")

_STREAM_CHUNK = 4 * 1024 * 1024  # Python gRPC moves 1-4 MB messages fastest
HEADROOM = 64 * 1024
"""Bytes of a message kept free for its header (the rest may carry tensor bytes)."""


class _RingLayout:
    """Where each tensor of one batch lies in a ring slot (64-byte aligned offsets).

    Args:
        batch: a drawn batch or group (its first ``batch_size`` rows give the layout).
        batch_size: rows per batch.
    """

    def __init__(self, batch: SampleBatch, batch_size: int) -> None:
        columns = flatten(batch.data)
        self.keys = list(columns)
        tensors = [t[:batch_size] for t in
                   (*columns.values(), batch.ids, batch.weights, batch.probabilities)]
        self.specs = [(t.dtype, tuple(t.shape)) for t in tensors]
        self.offsets = []
        offset = 0
        for t in tensors:
            self.offsets.append(offset)
            offset = align(offset + t.numel() * t.element_size())
        self.slot_bytes = max(offset, 1)

    def views(self, ring: SharedRing, slot: int) -> list[torch.Tensor]:
        return [ring.view(slot, off, dtype, shape)
                for off, (dtype, shape) in zip(self.offsets, self.specs)]


class SampleStreamCall:
    """One SampleStream call: reads credits, draws batches, sends them.

    Args:
        servicer: the service (tables, executor, limits, draining flag, abort).
        requests: the learner's messages (raw bytes).
        context: the call's context.
    """

    def __init__(self, servicer: ReplayServicer, requests: AsyncIterator[bytes],
                 context: grpc.aio.ServicerContext) -> None:
        self._servicer = servicer
        self._requests = requests
        self._context = context
        self._credits = 0
        self._window = 1
        self._credit_event = asyncio.Event()
        self._client_done = False
        self._ring: SharedRing | None = None
        self._layout: _RingLayout | None = None
        self._ring_accepted = False

    async def run(self) -> AsyncIterator[bytes]:
        servicer = self._servicer
        try:
            first_raw = await self._requests.__anext__()
        except StopAsyncIteration:
            return
        first = await servicer._run(self._context, _parse_first, first_raw)
        request = first.request
        table = await servicer._run(self._context, servicer._tables.__getitem__, request.table)
        self._credits = self._window = first.credits
        reader = asyncio.create_task(self._read())
        want_ring = first.shared_memory and servicer.shared_memory
        note = ""
        if first.shared_memory and not servicer.shared_memory:
            note = "the server has shared_memory = false"
        elif want_ring and first.host_id != host_id():
            want_ring, note = False, "the learner runs on another host"
        index = 0
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    count = await self._next_count(request, table, index)
                    if count == 0:
                        return
                    pending = self._start_draw(table, request, index, count, index == 0 and want_ring)
                if servicer.draining:
                    pending.cancel()
                    await servicer._abort(self._context, ShuttingDownError("the server is shutting down"))
                chunks, count, ring_note = await servicer._await(self._context, pending)
                index += count
                pending = None
                if ring_note:
                    note = ring_note
                if note and index == count:  # first group: say why there is no ring
                    chunks[0] = _with_note(chunks[0], note)
                ahead = await self._next_count(request, table, index, wait=False)
                if ahead:
                    pending = self._start_draw(table, request, index, ahead, False)
                for chunk in chunks:
                    yield chunk
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
            elif pending is not None and not pending.cancelled():
                pending.exception()  # retrieved, so asyncio does not log it as lost
            reader.cancel()
            self._close_ring()

    # ------------------------------------------------------------ credits

    async def _read(self) -> None:
        """Take credits and the shared-memory answer from the learner's messages."""
        try:
            async for raw in self._requests:
                try:
                    message = pb.SampleStreamRequest.FromString(raw)
                except Exception:
                    log.warning("SampleStream: ignoring a malformed credit message")
                    continue
                if message.credits > 0:
                    self._credits += message.credits
                if message.HasField("shared_memory_answer"):
                    self._on_answer(message.shared_memory_answer)
                self._credit_event.set()
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        finally:
            self._client_done = True
            self._credit_event.set()

    def _on_answer(self, answer: pb.SharedMemoryAnswer) -> None:
        ring = self._ring
        if ring is None:
            return
        ring.unlink()  # both sides hold a mapping now (or never will): the name can go
        if answer.accepted:
            self._ring_accepted = True
        else:
            log.info("SampleStream: the learner refused the shared-memory ring (%s); using gRPC",
                     answer.reason)
            self._close_ring()

    async def _next_count(self, request: pb.SampleRequest, table: Table, index: int,
                          wait: bool = True) -> int:
        """How many batches to draw next at ``index`` (0: the stream is over or, if not wait, no credit)."""
        remaining = request.num_batches - index if request.num_batches else MAX_BATCH_SIZE
        if remaining <= 0:
            return 0
        while self._credits <= index:
            if not wait or self._client_done:
                return 0
            self._credit_event.clear()
            await self._credit_event.wait()
        if self._ring_accepted:
            return 1
        count = min(max(1, request.batches_per_message), remaining, self._credits - index)
        batch_bytes = estimated_bytes(table, request.batch_size)
        if batch_bytes:
            count = max(1, min(count, _STREAM_CHUNK // batch_bytes))
        if count > 1 and request.batch_size * count > MAX_BATCH_SIZE:
            count = 1
        return count

    # ------------------------------------------------------------ drawing (engine threads)

    def _start_draw(self, table: Table, request: pb.SampleRequest, index: int, count: int,
                    offer_ring: bool) -> asyncio.Future:
        """Draw in the engine's pool, waiting (without a thread) while the rate limiter holds it."""
        return asyncio.ensure_future(self._servicer._change(
            self._context, self._draw, table, request, index, count, offer_ring, aborting=False))

    def _draw(self, table: Table, request: pb.SampleRequest, index: int, count: int,
              offer_ring: bool) -> tuple[str, tuple[list[bytes], int, str]]:
        if self._ring_accepted and self._ring is not None and self._layout is not None:
            return table.name, ([self._draw_into_ring(table, request, index)], 1, "")
        try:
            batch = table.sample(request.batch_size * count)
        except RateLimitedError:
            if count == 1:
                raise
            count = 1  # a group the limiter holds back is drawn as a single batch
            batch = table.sample(request.batch_size)
        chunk_bytes = max(1, min(_STREAM_CHUNK, self._servicer._max_message - HEADROOM))
        chunks = messages.encode_sample(batch, index, chunk_bytes, batch_count=count)
        note = ""
        if offer_ring:
            note = self._create_ring(batch, request.batch_size)
            if self._ring is not None:
                chunks[0] = _with_offer(chunks[0], self._ring)
        return table.name, (chunks, count, note)

    def _create_ring(self, batch: SampleBatch, batch_size: int) -> str:
        layout = _RingLayout(batch, batch_size)
        try:
            self._ring = SharedRing.create(self._window + 1, layout.slot_bytes)
        except SharedMemoryError as exc:
            log.warning("SampleStream: no shared-memory ring (%s); using gRPC", exc)
            return f"the server could not create a shared-memory ring: {exc}"
        self._layout = layout
        return ""

    def _draw_into_ring(self, table: Table, request: pb.SampleRequest, index: int) -> bytes:
        ring, layout = self._ring, self._layout
        assert ring is not None and layout is not None
        slot = index % ring.slots
        views = layout.views(ring, slot)
        n = len(layout.keys)
        batch = table.sample(request.batch_size, out=dict(zip(layout.keys, views[:n])))
        for dest, src in zip(views[n:], (batch.ids, batch.weights, batch.probabilities)):
            dest.copy_(src)
        header = pb.SampleResponse(
            columns=[spec_of(key, view) for key, view in zip(layout.keys, views[:n])],
            ids=spec_of("ids", views[n]),
            weights=spec_of("weights", views[n + 1]),
            probabilities=spec_of("probabilities", views[n + 2]),
            batch_index=index,
            batch_rows=request.batch_size,
            last_chunk=True,
            batch_count=1,
            shared_memory=pb.SharedMemoryBatch(slot=slot, offsets=layout.offsets),
        )
        return header.SerializeToString()

    def _close_ring(self) -> None:
        ring, self._ring = self._ring, None
        self._ring_accepted = False
        if ring is not None:
            ring.unlink()
            ring.close()


def _parse_first(raw: bytes) -> pb.SampleStreamRequest:
    try:
        first = pb.SampleStreamRequest.FromString(raw)
    except Exception as exc:
        raise InvalidArgumentError(f"malformed SampleStreamRequest: {exc}") from None
    if not first.HasField("request"):
        raise InvalidArgumentError("the first SampleStream message must carry `request`")
    request = first.request
    for name in ("num_batches", "batches_per_message"):
        if getattr(request, name) < 0:
            raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(request, name)}")
    if not 1 <= first.credits <= 1024:
        raise InvalidArgumentError(
            f"the first SampleStream message must grant credits in [1, 1024] (the prefetch "
            f"window), got {first.credits}")
    return first


def _with_offer(chunk: bytes, ring: SharedRing) -> bytes:
    offer = pb.SampleResponse(shared_memory_offer=pb.SharedMemoryOffer(
        name=ring.name, token=ring.token, slots=ring.slots, slot_bytes=ring.slot_bytes,
        header_bytes=ring.header_bytes))
    return offer.SerializeToString() + chunk  # protobuf merges concatenated messages


def _with_note(chunk: bytes, note: str) -> bytes:
    return pb.SampleResponse(transport_note=note).SerializeToString() + chunk


def estimated_bytes(table: Any, batch_size: int) -> int:
    """About how many bytes a batch of ``batch_size`` takes on the wire (0: unknown or invalid)."""
    schema = table.schema
    if schema is None or not 1 <= batch_size <= MAX_BATCH_SIZE:
        return 0
    steps = table.config.slice_len or 1
    return batch_size * (steps * (schema.row_bytes + 8) + 4 + 8)
