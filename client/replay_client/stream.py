"""The learner's network stream: SampleStream over gRPC, or a same-host shared-memory ring.

:class:`NetworkSource` is the :class:`~replay_feed.core.Source` behind
``ReplayClient.stream``: on the feed's background thread it runs the
bidirectional ``SampleStream`` call, grants one credit per batch the learner
takes, and turns each message into a batch in the feed's staging ring
(payload chunks decoded in place by the wire package's one
:class:`~replay_proto.sample_codec.SampleDecoder`) or into views of the
shared-memory ring the server offered (nothing to copy).

Restart policy: when the connection is lost (UNAVAILABLE: server restarted,
draining or unreachable) the stream reconnects with backoff for up to the
connection's ``max_retry_s`` (the client's one
:class:`~replay_client.backoff.Backoff` schedule) and goes on with new batches (sampling has no
position to resume from; the batch in flight is dropped); the learner's loop
does not notice beyond ``stream.stats.reconnects``. With ``reconnect=False``,
or when the server stays away longer, the learner gets
:class:`~replay_client.errors.UnavailableError` after the batches already
received. Every other server error ends the stream with its typed exception.

Waiting for data (``wait``, the default): each request asks the server to
hold a batch while the table cannot serve it, so a learner that starts
before its actors, or reconnects to a restarted server whose tables are
empty, waits instead of failing with ``EmptyTableError``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from replay_client.backoff import Backoff
from replay_client.connection import Connection
from replay_client.errors import UnavailableError
from replay_feed.core import FeedCore
from replay_feed.shared_ring import SharedMemoryError, SharedRing, host_id
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, request_bytes_metadata
from replay_proto.sample_codec import Layout, SampleDecoder, split_sample
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.stream")


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
        connection: the server (address, token, retry window).
        table: table name.
        batch_size: rows (or slices) per batch.
        num_batches: batches to deliver in all (0: until the learner stops).
        batches_per_message: let the server draw and send that many batches at
            once (gRPC path only; a throughput trade-off for small rows).
        shared_memory: offer to read a same-host ring (falls back to gRPC when
            the server cannot or the ring cannot be mapped).
        reconnect: reconnect after a lost connection (see the restart policy).
        wait: the server waits while the table cannot serve a batch (also after a reconnect).
        wait_timeout: seconds a batch may wait (``None``: no limit).
    """

    def __init__(self, connection: Connection, table: str, batch_size: int, *, num_batches: int,
                 batches_per_message: int, shared_memory: bool, reconnect: bool,
                 wait: bool = True, wait_timeout: float | None = None) -> None:
        self.connection = connection
        self.table = table
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.batches_per_message = batches_per_message
        self.shared_memory = shared_memory
        self.reconnect = reconnect
        self.wait = wait
        self.wait_timeout = wait_timeout
        self.lock = threading.Lock()
        self.granted = 0  # credits sent to servers beyond the window (one per batch taken)
        self.core: FeedCore = None  # type: ignore[assignment]  # set by run()
        self._received = 0
        self._call: Any = None
        self._ring: SharedRing | None = None
        self._registered = False
        self._stopped = threading.Event()

    # ------------------------------------------------------------ the loop

    def run(self, core: FeedCore) -> None:
        self.core = core
        core.stats.transport = "grpc"
        address = self.connection.address
        backoff: Backoff | None = None
        try:
            while not self._stopped.is_set():
                remaining = self.num_batches - self._received if self.num_batches else 0
                if self.num_batches and remaining <= 0:
                    return
                try:
                    if self._run_call(core, remaining, reconnected=backoff is not None):
                        return
                except grpc.RpcError as exc:
                    if self._stopped.is_set():
                        return
                    error = self.connection.error(exc)
                    if not (self.reconnect and isinstance(error, UnavailableError)):
                        raise error from None
                    if backoff is None:
                        window = self.connection.retry_window()
                        backoff = Backoff(window)
                        log.warning("stream from %s lost (%s); reconnecting for up to %.0f s",
                                    address, error, window)
                    delay = backoff.next_delay()
                    if delay is None and not self.connection.answered:
                        raise error from None  # "no replay server at ..."
                    if delay is None:
                        raise UnavailableError(
                            f"stream from {address} lost and not back within "
                            f"{window:.0f} s: {error}") from None
                    self._stopped.wait(delay)
                    continue
                backoff = None
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
                                   batches_per_message=self.batches_per_message,
                                   wait_for_data=self.wait,
                                   wait_timeout_s=self.wait_timeout or 0.0)
        first = pb.SampleStreamRequest(request=request, credits=credits,
                                       shared_memory=self.shared_memory, host_id=host_id())
        outgoing = _Call(self, first.SerializeToString())
        self._release_ring()
        connection = self.connection
        call = connection.method("SampleStream", kind="stream_stream")(
            outgoing.requests(),
            metadata=connection.metadata + request_bytes_metadata(STREAM_MESSAGE_BYTES))
        self._call = call
        if self._stopped.is_set():
            call.cancel()
        base = self._received

        def staging(index: int, layout: Layout) -> list[torch.Tensor]:
            return core.staging(base + index, layout)

        decoder = SampleDecoder(self.batch_size, allocate=staging, ring_view=self._ring_view,
                                copy=core.copy_rows)
        first_message = True
        try:
            for raw in call:
                header, payload = split_sample(raw)
                if first_message:
                    first_message = False
                    connection.answered = True
                    self._on_first(core, header, outgoing, reconnected)
                for batch in decoder.add(header, payload):
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
            log.info("stream from %s resumed", self.connection.address)
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
                ring.unlink()
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

    def _ring_view(self, slot: int, offset: int, dtype: torch.dtype,
                   shape: tuple[int, ...]) -> torch.Tensor:
        ring = self._ring
        if ring is None:
            raise SharedMemoryError("no shared-memory ring is mapped")
        return ring.view(slot, offset, dtype, shape)

    def _register(self, core: FeedCore, ring: SharedRing) -> None:
        accel = core.delivery.accelerator
        if core.delivery.pin and accel is not None:
            try:
                self._registered = accel.register(ring.whole())
            except Exception as exc:  # a driver refusing is not fatal: staging copies instead
                log.info("could not pin the shared-memory ring (%s); copying to pinned staging", exc)
                self._registered = False

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
