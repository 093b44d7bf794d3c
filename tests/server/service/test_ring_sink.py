"""The shared-memory ring's server side: a ring is never left behind by a call that ended."""

from __future__ import annotations

import torch

from replay_feed.shared_ring import SharedRing, host_id
from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass
from replay_proto.v1 import replay_pb2 as pb
from replay_server.service.batch_sink import SinkContext, StreamLimits
from replay_server.service.budget import MemoryBudget
from replay_server.service.ring_sink import RingSink

MIB = 2**20


def sink(budget: MemoryBudget, rings: MemoryBudget) -> RingSink:
    limits = StreamLimits(max_message_bytes=4 * MIB, shared_memory=True, max_batch_bytes=MIB,
                          budget=budget, shared_memory_budget=rings, closing_wait_s=1.0)
    first = pb.SampleStreamRequest(shared_memory=True, host_id=host_id())
    return RingSink(SinkContext(first, limits, budget.reserve(0, "the call"), 2,
                                lambda *_: None))


def batch() -> SampleBatch:
    return SampleBatch.from_columns({"obs": torch.zeros(4, 16)}, torch.arange(4),
                                    torch.ones(4), torch.full((4,), 0.25, dtype=torch.float64),
                                    SamplingMass(4.0, 1.0, 4))


def test_a_ring_made_while_its_call_ends_is_removed_not_offered(tmp_path, monkeypatch) -> None:
    """The offer runs in an engine thread; the call can end (its sinks closed, on the loop)
    while the ring is being created. The ring was then left in /dev/shm and its bytes
    counted (seen under load: a Ray shard's /dev/shm kept a ring after its shutdown)."""
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    rings = MemoryBudget(16 * MIB, what="server.shared_memory_mb")
    ring_sink = sink(MemoryBudget(64 * MIB), rings)
    create = SharedRing.create

    def ended_meanwhile(slots: int, slot_bytes: int) -> SharedRing:
        ring = create(slots, slot_bytes)
        ring_sink.close()  # the call ended while the ring was made
        return ring

    monkeypatch.setattr(SharedRing, "create", staticmethod(ended_meanwhile))
    head, note = ring_sink.offer(batch(), 4)
    assert (head, note) == (b"", "the stream ended")
    assert list(tmp_path.iterdir()) == []
    assert rings.in_use == 0


def test_a_ring_offered_is_removed_when_its_call_ends(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    rings = MemoryBudget(16 * MIB, what="server.shared_memory_mb")
    ring_sink = sink(MemoryBudget(64 * MIB), rings)
    head, note = ring_sink.offer(batch(), 4)
    assert head and note == ""
    assert len(list(tmp_path.iterdir())) == 1 and rings.in_use > 0
    ring_sink.close()
    assert list(tmp_path.iterdir()) == [] and rings.in_use == 0
