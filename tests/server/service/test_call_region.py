"""A call stream's shared-memory region for inserts, on the server's side: made, offered,
mapped, read within its bounds, and removed with everything it reserved whenever the stream
ends, even while the region is still being made (tests/integration/test_insert_regions.py
drives it through a real server)."""

from __future__ import annotations

import pytest
import torch

from replay_feed.shared_ring import SharedRing, host_id
from replay_proto.v1 import replay_pb2 as pb
from replay_server.errors import FailedPreconditionError, InvalidArgumentError
from replay_server.service.budget import MemoryBudget
from replay_server.service.call_region import MAX_REGION_BYTES, CallRegion
from replay_server.service.status import LimitExceededError, OverloadedError

MIB = 2**20


def _ask(nbytes: int = MIB, host: str | None = None) -> pb.SharedInsertRegion:
    return pb.SharedInsertRegion(host_id=host_id() if host is None else host, bytes=nbytes)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    return tmp_path


def test_a_region_is_offered_mapped_read_and_removed_with_the_stream(shm) -> None:
    budget = MemoryBudget(16 * MIB, what="server.shared_memory_mb")
    region = CallRegion(True, budget)
    offer = region.open(_ask())
    assert len(list(shm.iterdir())) == 1 and budget.in_use >= MIB
    client = SharedRing.open(offer.name, offer.token, offer.slots, offer.slot_bytes,
                             offer.header_bytes)
    with pytest.raises(InvalidArgumentError, match="without a region mapped"):
        region.request(10)  # offered, not yet answered
    assert region.answered(pb.SharedMemoryAnswer(accepted=True)).accepted
    assert list(shm.iterdir()) == []  # the name goes once the client answered
    client.slot(0)[:5] = torch.frombuffer(bytearray(b"hello"), dtype=torch.uint8)
    assert bytes(region.request(5)) == b"hello"
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        region.request(offer.slot_bytes + 1)
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        region.request(0)
    region.close()
    assert budget.in_use == 0
    with pytest.raises(InvalidArgumentError, match="without a region"):
        region.request(5)


def test_a_region_made_while_its_stream_ends_is_removed_not_offered(shm, monkeypatch) -> None:
    budget = MemoryBudget(16 * MIB, what="server.shared_memory_mb")
    region = CallRegion(True, budget)
    create = SharedRing.create

    def ended_meanwhile(slots: int, slot_bytes: int) -> SharedRing:
        ring = create(slots, slot_bytes)
        region.close()  # the stream ended (on the loop) while the pool made the region
        return ring

    monkeypatch.setattr(SharedRing, "create", staticmethod(ended_meanwhile))
    with pytest.raises(InvalidArgumentError, match="ended while its region was made"):
        region.open(_ask())
    assert list(shm.iterdir()) == [] and budget.in_use == 0


def test_refusals_say_why_and_reserve_nothing(shm) -> None:
    budget = MemoryBudget(4 * MIB, what="server.shared_memory_mb")
    with pytest.raises(FailedPreconditionError, match="shared_memory = false"):
        CallRegion(False, budget).open(_ask())
    region = CallRegion(True, budget)
    with pytest.raises(FailedPreconditionError, match="another host"):
        region.open(_ask(host="elsewhere"))
    with pytest.raises(InvalidArgumentError, match="bytes must be > 0"):
        region.open(_ask(0))
    with pytest.raises(LimitExceededError, match="more than a call stream's region"):
        region.open(_ask(MAX_REGION_BYTES + 1))
    with pytest.raises((LimitExceededError, OverloadedError), match="shared_memory_mb"):
        region.open(_ask(8 * MIB))  # over the budget
    assert list(shm.iterdir()) == [] and budget.in_use == 0


def test_a_new_region_replaces_the_old_and_a_refused_map_drops_it(shm) -> None:
    budget = MemoryBudget(16 * MIB, what="server.shared_memory_mb")
    region = CallRegion(True, budget)
    region.open(_ask(MIB))
    assert budget.in_use == SharedRing.size_for(1, MIB)
    region.open(_ask(2 * MIB))  # replaces: the first one's bytes and name go
    assert budget.in_use == SharedRing.size_for(1, 2 * MIB) and len(list(shm.iterdir())) == 1
    said = region.answered(pb.SharedMemoryAnswer(accepted=False, reason="cannot map"))
    assert not said.accepted and said.reason == "cannot map"
    assert budget.in_use == 0 and list(shm.iterdir()) == []
    region.close()
