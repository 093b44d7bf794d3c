"""The shared-memory ring's server side: batches gathered straight into a /dev/shm ring slot.

Same host: if the learner asked for shared memory and runs on this host
(same boot id), the server creates a ring of ``window + 1`` slots in
/dev/shm sized for one batch each and offers it with the first batch. Once
the learner accepts, batches are gathered straight from table storage into
the ring (no serialization, no copy through gRPC) and messages carry only
offsets. Batch ``k`` goes into slot ``k % slots``; the credit rule guarantees
the learner has given that slot back. The ring's name is unlinked as soon as
the learner answers (the learner unlinks it too, once mapped), and a server
removes rings that dead servers left behind when it starts
(:func:`~replay_feed.shared_ring.sweep_stale_rings`). All rings together may
take ``shared_memory_mb``; a ring that would not fit is not offered (the
first batch says why) and the stream uses gRPC. A group in the ring holds
only its ids, weights and probabilities beside it.

The learner's side is ``replay_client.ring_source``; the ring itself
:mod:`replay_feed.shared_ring`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from replay_feed.shared_ring import SharedMemoryError, SharedRing, align, host_id, sweep_stale_rings
from replay_proto.batch import SampleBatch
from replay_proto.sample_codec import encode_ring_batch, with_offer
from replay_proto.v1 import replay_pb2 as pb
from replay_server.service.batch_sink import Draw, SinkContext
from replay_server.service.budget import Reservation
from replay_server.service.status import LimitExceededError, OverloadedError

if TYPE_CHECKING:
    from replay_server.service.settings import ServerSettings

log = logging.getLogger("replay_server")


class RingLayout:
    """Where each tensor of one batch lies in a ring slot (64-byte aligned offsets).

    Args:
        batch: a drawn batch or group (its first ``batch_size`` rows give the layout).
        batch_size: rows per batch.
    """

    def __init__(self, batch: SampleBatch, batch_size: int) -> None:
        self.keys = list(batch.columns)
        tensors = [t[:batch_size] for t in batch.tensors()]
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


class RingSink:
    """One stream's shared-memory ring (see the module docstring); made by :data:`RING`."""

    name = "shared_memory"

    def __init__(self, context: SinkContext) -> None:
        self._context = context
        self._ring: SharedRing | None = None
        self._layout: RingLayout | None = None
        self._reservation: Reservation | None = None
        # The offer is made in an engine thread and the call may end (close, on the loop)
        # while it creates the ring: whichever comes second removes it.
        self._lock = threading.Lock()
        self._closed = False

    def group(self, wanted: int, batch_size: int, batch_bytes: int) -> int:
        return 1  # one batch per slot

    def held_bytes(self, count: int, batch_bytes: int, extras: int) -> int:
        return extras

    def offer(self, batch: SampleBatch, batch_size: int) -> tuple[bytes, str]:
        context = self._context
        layout = RingLayout(batch, batch_size)
        slots = context.window + 1
        size = SharedRing.size_for(slots, layout.slot_bytes)
        try:
            reservation = context.limits.shared_memory_budget.reserve(
                size, f"a shared-memory ring of {slots} batches", owner=context.owner)
        except (OverloadedError, LimitExceededError) as exc:
            context.log("ring_over_budget", logging.INFO,
                        f"no shared-memory ring ({exc}); using gRPC")
            return b"", f"no shared-memory ring: {exc}"
        try:
            ring = SharedRing.create(slots, layout.slot_bytes)
        except SharedMemoryError as exc:
            reservation.release()
            context.log("ring_failed", logging.WARNING,
                        f"no shared-memory ring ({exc}); using gRPC")
            return b"", f"the server could not create a shared-memory ring: {exc}"
        with self._lock:
            ended = self._closed
            if not ended:
                self._ring, self._layout, self._reservation = ring, layout, reservation
        if ended:  # the call ended while the ring was made: never offered
            ring.unlink()
            ring.close()
            reservation.release()
            return b"", "the stream ended"
        return with_offer(b"", pb.SharedMemoryOffer(
            name=ring.name, token=ring.token, slots=ring.slots, slot_bytes=ring.slot_bytes,
            header_bytes=ring.header_bytes)), ""

    def answered(self, message: pb.SampleStreamRequest) -> bool | None:
        ring = self._ring
        if ring is None or not message.HasField("shared_memory_answer"):
            return None
        ring.unlink()  # both sides hold a mapping now (or never will): the name can go
        answer = message.shared_memory_answer
        if answer.accepted:
            return True
        self._context.log("ring_refused", logging.INFO, f"the learner refused the shared-memory "
                          f"ring ({answer.reason}); using gRPC")
        self.close()
        return False

    def send(self, draw: Draw, index: int, count: int) -> tuple[list[bytes], int, SampleBatch]:
        ring, layout = self._ring, self._layout
        assert ring is not None and layout is not None
        slot = index % ring.slots
        views = layout.views(ring, slot)
        n = len(layout.keys)
        columns = dict(zip(layout.keys, views[:n]))
        batch, _ = draw(1, columns)
        for dest, src in zip(views[n:], batch.extras):
            dest.copy_(src)
        message = encode_ring_batch(columns, views[n:], index, slot, layout.offsets, batch.mass)
        return [message], 1, batch

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ring, self._ring = self._ring, None
            reservation, self._reservation = self._reservation, None
        if ring is not None:
            ring.unlink()
            ring.close()
        if reservation is not None:
            reservation.release()


class RingSinks:
    """The ring's entry in the sink registry: a ring for a learner that asked for shared
    memory on this host, while the server offers shared memory."""

    name = RingSink.name

    def open(self, context: SinkContext) -> tuple[RingSink | None, str]:
        first = context.first
        if not first.shared_memory:
            return None, ""
        if not context.limits.shared_memory:
            return None, "the server has shared_memory = false"
        if first.host_id != host_id():
            return None, "the learner runs on another host"
        return RingSink(context), ""

    def prepare(self, settings: ServerSettings) -> None:
        if settings.shared_memory:
            for name in sweep_stale_rings():
                log.warning("removed shared-memory ring %s left by a server that is gone", name)


RING = RingSinks()
