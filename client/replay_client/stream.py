"""The learner's network stream: SampleStream over gRPC, or a same-host shared-memory ring.

:class:`NetworkSource` is the :class:`~replay_proto.feed.Source` behind
``ReplayClient.stream``: on the feed's background thread it runs the
bidirectional ``SampleStream`` call, grants one credit per batch the learner
takes, and turns each message into a batch in the feed's staging ring
(payload chunks decoded in place) or into views of the shared-memory ring
the server offered (nothing to decode).

Restart policy: when the connection is lost (UNAVAILABLE: server restarted,
draining or unreachable) the stream reconnects with backoff for up to the
client's ``max_retry_s`` and goes on with new batches (sampling has no
position to resume from; the batch in flight is dropped); the learner's loop
does not notice beyond ``stream.stats.reconnects``. With ``reconnect=False``,
or when the server stays away longer, the learner gets
:class:`~replay_client.errors.UnavailableError` after the batches already
received. Every other server error ends the stream with its typed exception.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
import torch

from replay_client.errors import UnavailableError, from_rpc_error
from replay_proto.batch import SampleBatch
from replay_proto.codec import CodecError, copy_rows, decode_tensors, expect_end, split_payload
from replay_proto.dtypes import dtype_from_name
from replay_proto.feed import FeedCore, Layout
from replay_proto.keys import unflatten
from replay_proto.shm import SharedMemoryError, SharedRing, host_id
from replay_proto.v1 import replay_pb2 as pb

if TYPE_CHECKING:
    from replay_client.client import ReplayClient

log = logging.getLogger("replay_client.stream")

# Internal keys of the extras in a staging slot (cannot clash with column keys).
_EXTRAS = ("\0ids", "\0weights", "\0probabilities")


class _Call:
    """One SampleStream call's outgoing side: the first message, then credits and answers."""

    def __init__(self, source: NetworkSource, first: bytes) -> None:
        self.source = source
        self.first = first
        self.done = False
        self.answers: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def requests(self) -> Iterator[bytes]:
        yield self.first
        core = self.source.core
        while True:
            credits = core.wait_credits()
            if self.done or core.stopping.is_set():
                core.return_credits(credits)
                return
            while True:
                try:
                    yield self.answers.get_nowait()
                except queue.Empty:
                    break
            if credits:
                with self.source.lock:
                    self.source.granted += credits
                yield pb.SampleStreamRequest(credits=credits).SerializeToString()

    def answer(self, accepted: bool, reason: str = "") -> None:
        self.answers.put(pb.SampleStreamRequest(shared_memory_answer=pb.SharedMemoryAnswer(
            accepted=accepted, reason=reason)).SerializeToString())
        self.source.core.wake()


class NetworkSource:
    """Produces a feed's batches from a server's SampleStream (see the module docstring).

    Args:
        client: the connection (address, token, retry window).
        table: table name.
        batch_size: rows (or slices) per batch.
        num_batches: batches to deliver in all (0: until the learner stops).
        batches_per_message: let the server draw and send that many batches at
            once (gRPC path only; a throughput trade-off for small rows).
        shared_memory: offer to read a same-host ring (falls back to gRPC when
            the server cannot or the ring cannot be mapped).
        reconnect: reconnect after a lost connection (see the restart policy).
    """

    def __init__(self, client: ReplayClient, table: str, batch_size: int, *, num_batches: int,
                 batches_per_message: int, shared_memory: bool, reconnect: bool) -> None:
        self.client = client
        self.table = table
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.batches_per_message = batches_per_message
        self.shared_memory = shared_memory
        self.reconnect = reconnect
        self.lock = threading.Lock()
        self.granted = 0  # credits sent to servers beyond the window (one per batch taken)
        self.core: FeedCore = None  # type: ignore[assignment]  # set by run()
        self._received = 0
        self._call: Any = None
        self._outgoing: _Call | None = None
        self._ring: SharedRing | None = None
        self._registered = False
        self._stopped = threading.Event()

    # ------------------------------------------------------------ the loop

    def run(self, core: FeedCore) -> None:
        self.core = core
        core.stats.transport = "grpc"
        retry_until: float | None = None
        delay = 0.05
        try:
            while not self._stopped.is_set():
                remaining = self.num_batches - self._received if self.num_batches else 0
                if self.num_batches and remaining <= 0:
                    return
                try:
                    if self._run_call(core, remaining, reconnected=retry_until is not None):
                        return
                except grpc.RpcError as exc:
                    if self._stopped.is_set():
                        return
                    error = from_rpc_error(exc, self.client.address)
                    if not (self.reconnect and isinstance(error, UnavailableError)):
                        raise error from None
                    now = time.monotonic()
                    if retry_until is None:
                        retry_until = now + self.client._max_retry_s
                        log.warning("stream from %s lost (%s); reconnecting for up to %.0f s",
                                    self.client.address, error, self.client._max_retry_s)
                    if now + delay > retry_until:
                        raise UnavailableError(
                            f"stream from {self.client.address} lost and not back within "
                            f"{self.client._max_retry_s:.0f} s: {error}") from None
                    self._stopped.wait(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
                    continue
                retry_until, delay = None, 0.05
        finally:
            self._release_ring()

    def _run_call(self, core: FeedCore, remaining: int, reconnected: bool) -> bool:
        """One call until it ends; True when the stream is complete."""
        while True:
            with self.lock:
                # A new server may run `prefetch + taken` ahead of the learner, minus what arrived.
                credits = core.prefetch + self.granted - self._received
            if credits >= 1:
                break
            # Reconnecting while the learner's window is full: wait until it takes a batch.
            taken = core.wait_credits()
            if core.stopping.is_set():
                return True
            with self.lock:
                self.granted += taken
        request = pb.SampleRequest(table=self.table, batch_size=self.batch_size,
                                   num_batches=remaining,
                                   batches_per_message=self.batches_per_message)
        first = pb.SampleStreamRequest(request=request, credits=credits,
                                       shared_memory=self.shared_memory, host_id=host_id())
        outgoing = _Call(self, first.SerializeToString())
        self._release_ring()
        call = self.client._call("SampleStream", kind="stream_stream")(
            outgoing.requests(), metadata=self.client._metadata)
        self._call, self._outgoing = call, outgoing
        if self._stopped.is_set():
            call.cancel()
        base = self._received
        decoder = _GroupDecoder(core, self.batch_size)
        first_message = True
        try:
            for raw in call:
                header, payload = split_payload(raw, pb.SampleResponse)
                if first_message:
                    first_message = False
                    self._on_first(core, header, outgoing, reconnected)
                index = base + header.batch_index
                if header.HasField("shared_memory"):
                    batches = [self._ring_batch(header)]
                else:
                    batches = decoder.add(header, payload, index)
                for batch in batches:
                    core.deliver(self._received, batch)
                    self._received += 1
        finally:
            outgoing.done = True
            core.wake()
        return bool(self.num_batches) and self._received >= self.num_batches

    def stop(self) -> None:
        self._stopped.set()
        call = self._call
        if call is not None:
            call.cancel()

    # ------------------------------------------------------------ shared memory

    def _on_first(self, core: FeedCore, header: pb.SampleResponse, outgoing: _Call,
                  reconnected: bool) -> None:
        if reconnected:
            core.stats.reconnects += 1
            log.info("stream from %s resumed", self.client.address)
        if header.HasField("shared_memory_offer"):
            offer = header.shared_memory_offer
            try:
                ring = SharedRing.open(offer.name, offer.token, offer.slots, offer.slot_bytes,
                                       offer.header_bytes)
            except SharedMemoryError as exc:
                outgoing.answer(False, str(exc))
                core.stats.notes.append(f"gRPC: could not map the server's ring ({exc})")
                core.stats.transport = "grpc"
                return
            if ring.slots != core.slots:
                ring.close()
                reason = f"the ring has {offer.slots} slots, this stream needs {core.slots}"
                outgoing.answer(False, reason)
                core.stats.notes.append(f"gRPC: {reason}")
                return
            ring.unlink()  # mapped on both sides: the name can go (the server unlinks too)
            self._ring = ring
            self._register(core, ring)
            outgoing.answer(True)
            core.stats.transport = "shared_memory"
            core.stats.notes.append(
                f"shared memory: {ring.slots} slots of {ring.slot_bytes / 2**20:.1f} MiB"
                + ("" if not core.delivery.pin else
                   ", pinned in place" if self._registered else ", copied to pinned staging"))
        else:
            core.stats.transport = "grpc"
            if header.transport_note:
                core.stats.notes.append(f"gRPC: {header.transport_note}")
            elif self.shared_memory:
                core.stats.notes.append("gRPC: the server offered no shared-memory ring")

    def _register(self, core: FeedCore, ring: SharedRing) -> None:
        accel = core.delivery.accelerator
        if core.delivery.pin and accel is not None:
            try:
                self._registered = accel.register(ring.whole())
            except Exception as exc:  # a driver refusing is not fatal: staging copies instead
                log.info("could not pin the shared-memory ring (%s); copying to pinned staging", exc)
                self._registered = False

    def _ring_batch(self, header: pb.SampleResponse) -> SampleBatch:
        ring = self._ring
        if ring is None:
            raise CodecError("a shared-memory batch arrived but no ring is mapped")
        specs = [*header.columns, header.ids, header.weights, header.probabilities]
        offsets = header.shared_memory.offsets
        if len(offsets) != len(specs):
            raise CodecError(f"{len(offsets)} offsets for {len(specs)} tensors")
        tensors = {}
        for spec, offset in zip(specs, offsets):
            try:
                tensors[spec.key] = ring.view(header.shared_memory.slot, offset,
                                              dtype_from_name(spec.dtype), tuple(spec.shape))
            except (SharedMemoryError, ValueError) as exc:
                raise CodecError(f"bad shared-memory descriptor for {spec.key!r}: {exc}") from None
        extras = [tensors.pop(name) for name in ("ids", "weights", "probabilities")]
        return SampleBatch(unflatten(tensors), *extras)

    def _release_ring(self) -> None:
        ring, self._ring = self._ring, None
        if ring is None:
            return
        if self._registered and self.core.delivery.accelerator is not None:
            try:
                self.core.delivery.accelerator.unregister(ring.whole())
            except Exception:  # pragma: no cover - driver teardown
                pass
        self._registered = False
        ring.close()


class _GroupDecoder:
    """Decodes payload chunks of a group of batches straight into the feed's staging slots."""

    def __init__(self, core: FeedCore, batch_size: int) -> None:
        self._core = core
        self._batch_size = batch_size
        self._group: int | None = None
        self._next_row = 0
        self._rows = 0
        self._slots: list[dict[str, torch.Tensor]] = []
        self._keys: list[str] = []

    def add(self, header: pb.SampleResponse, payload: memoryview, index: int) -> list[SampleBatch]:
        specs = [*header.columns, header.ids, header.weights, header.probabilities]
        tensors, offset = decode_tensors(specs, payload)
        expect_end(payload, offset)
        size = self._batch_size
        if header.row_start == 0:
            count = max(1, header.batch_count)
            if header.batch_rows != count * size:
                raise CodecError(f"a group of {count} batches of {size} has {header.batch_rows} rows")
            self._group, self._next_row, self._rows = index, 0, header.batch_rows
            self._keys = [s.key for s in header.columns]
            names = [*self._keys, *_EXTRAS]
            layout: Layout = tuple(
                (name, t.dtype, (size, *t.shape[1:])) for name, t in zip(names, tensors.values()))
            self._slots = [self._core.staging(index + i, layout) for i in range(count)]
        if self._group is None or index != self._group or header.row_start != self._next_row:
            raise CodecError(f"chunk of batch {header.batch_index} at row {header.row_start} "
                             f"arrived out of order")
        names = [*self._keys, *_EXTRAS]
        rows = 0
        for name, tensor in zip(names, tensors.values()):
            rows = tensor.shape[0]
            start = header.row_start
            while start < header.row_start + rows:  # rows may span several batches of the group
                b, r = divmod(start, size)
                n = min(size - r, header.row_start + rows - start)
                src = tensor[start - header.row_start : start - header.row_start + n]
                copy_rows(self._slots[b][name], r, src)
                start += n
        self._next_row += rows
        if not header.last_chunk:
            return []
        if self._next_row != self._rows:
            raise CodecError(f"batch {header.batch_index} ended after {self._next_row} of "
                             f"{self._rows} rows")
        self._group = None
        out = []
        for slot in self._slots:
            columns = {key: slot[key] for key in self._keys}
            out.append(SampleBatch(unflatten(columns), *(slot[name] for name in _EXTRAS)))
        return out

