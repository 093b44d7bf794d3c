"""The shared-memory ring's learner side: batches read as views of a same-host /dev/shm ring.

A learner on the server's host asks for shared memory in its first message
(with its host's boot id); the server offers a ring of ``window + 1`` slots
with the first batch (``replay_server.service.ring_sink``). The learner maps
it, checks the slot count against its window, unlinks its name (mapped on
both sides: nothing is left in /dev/shm whoever exits first) and answers;
from then on each message names a slot and the tensors' offsets in it, and
the batch is a view of the ring (nothing to copy). Where the learner's feed
pins staging, the ring is registered with the accelerator (pinned in place)
or, if the driver refuses, copied into pinned staging. A ring that cannot be
mapped (another container's /dev/shm, another user) is refused with the
reason, and the stream stays on gRPC.
"""

from __future__ import annotations

import logging

import torch

from replay_client.batch_source import Opened, SourceContext
from replay_feed.shared_ring import SharedMemoryError, SharedRing, host_id
from replay_proto.batch import SampleBatch
from replay_proto.sample_codec import SampleDecoder
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.stream")


class RingSource:
    """A mapped ring (see the module docstring); made by :data:`RING`.

    Args:
        ring: the ring, mapped (its name already unlinked).
        context: the stream's delivery (to pin the ring in place).
    """

    name = "shared_memory"
    window_grows = False  # one slot per batch of the window, fixed when the ring was made

    def __init__(self, ring: SharedRing, context: SourceContext) -> None:
        self._ring: SharedRing | None = ring
        self._delivery = context.delivery
        self._decoder = SampleDecoder(ring_view=self._view)
        self.registered = self._register(ring)

    def batches(self, header: pb.SampleResponse, payload: memoryview) -> list[SampleBatch] | None:
        if not header.HasField("shared_memory"):
            return None
        return self._decoder.add(header, payload)

    def _view(self, slot: int, offset: int, dtype: torch.dtype,
              shape: tuple[int, ...]) -> torch.Tensor:
        ring = self._ring
        if ring is None:
            raise SharedMemoryError("no shared-memory ring is mapped")
        return ring.view(slot, offset, dtype, shape)

    def _register(self, ring: SharedRing) -> bool:
        delivery = self._delivery
        accel = None if delivery is None else delivery.accelerator
        if delivery is not None and delivery.pin and accel is not None:
            try:
                return bool(accel.register(ring.whole()))
            except Exception as exc:  # a driver refusing is not fatal: staging copies instead
                log.info("could not pin the shared-memory ring (%s); copying to pinned staging",
                         exc)
        return False

    def close(self) -> None:
        ring, self._ring = self._ring, None
        if ring is None:
            return
        delivery = self._delivery
        if self.registered and delivery is not None and delivery.accelerator is not None:
            try:
                delivery.accelerator.unregister(ring.whole())
            except Exception:  # pragma: no cover - driver teardown
                pass
        self.registered = False
        ring.close()


def _answer(accepted: bool, reason: str = "") -> pb.SampleStreamRequest:
    return pb.SampleStreamRequest(shared_memory_answer=pb.SharedMemoryAnswer(
        accepted=accepted, reason=reason))


class RingSources:
    """The ring's entry in the source registry (``shared_memory`` on the wire)."""

    name = RingSource.name
    title = "shared-memory ring"

    def ask(self, opening: pb.SampleStreamRequest, local: bool) -> bool:
        if not local:
            return False
        opening.shared_memory = True
        opening.host_id = host_id()
        return True

    def open(self, header: pb.SampleResponse, context: SourceContext) -> Opened | None:
        if not header.HasField("shared_memory_offer"):
            return None
        if context.refusal:  # the server unlinks the ring it offered
            return Opened(None, _answer(False, context.refusal), f"gRPC: {context.refusal}")
        offer = header.shared_memory_offer
        try:
            ring = SharedRing.open(offer.name, offer.token, offer.slots, offer.slot_bytes,
                                   offer.header_bytes)
        except SharedMemoryError as exc:
            return Opened(None, _answer(False, str(exc)),
                          f"gRPC: could not map the server's ring ({exc})")
        if ring.slots != context.window + 1:
            ring.unlink()
            ring.close()
            reason = f"the ring has {offer.slots} slots, this stream needs {context.window + 1}"
            return Opened(None, _answer(False, reason), f"gRPC: {reason}")
        ring.unlink()  # mapped on both sides: the name can go (the server unlinks too)
        source = RingSource(ring, context)
        delivery = context.delivery
        pin = delivery is not None and delivery.pin
        note = (f"shared memory: {ring.slots} slots of {ring.slot_bytes / 2**20:.1f} MiB"
                + ("" if not pin else
                   ", pinned in place" if source.registered else ", copied to pinned staging"))
        return Opened(source, _answer(True), note)


RING = RingSources()
