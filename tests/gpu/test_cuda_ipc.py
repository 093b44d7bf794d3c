"""CUDA IPC on a real GPU: a server process's cuda table streamed to this learner process.

Skipped without CUDA. The CPU version of the protocol (offer, refusals, ring
reuse, fallbacks) is ``tests/integration/test_cuda_ipc_transport.py``. Here the
server is a real ``replay-server`` process with a ``device = "cuda"`` table and
the learner is this process, streaming to ``cuda``. GPU machines here may run
under a sandbox (gVisor, Firecracker) that refuses CUDA IPC: then the learner
declines and the stream goes on with host copies. Every test passes either
way, asserting the outcome the stream reported (``stream.transport`` and its
note) and the batches' contents against the table in both cases.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from replay_client import ReplayClient  # noqa: E402
from tests.conftest import start_server  # noqa: E402

ROWS = 2000
CONFIG = """
[[tables]]
name = "g"
capacity = 2000
sampler = "prioritized"
device = "cuda"
"""


def _rows(start: int, n: int) -> dict[str, torch.Tensor]:
    row = torch.arange(start, start + n)
    return {"row": row,
            "frame": (row % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(n, 4, 84, 84).clone()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("cuda_ipc"), CONFIG)
    client = ReplayClient(proc.address)
    first = None
    for start in range(0, ROWS, 250):
        ids = client.insert("g", _rows(start, 250))
        first = int(ids[0]) if first is None else first
    yield client, first, proc
    client.close()
    proc.stop()


def _outcome(stream) -> str:
    """``"ipc"`` or ``"refused"``, checked against the stream's own note."""
    notes = stream.stats.notes
    if stream.transport == "cuda_ipc":
        assert any(note.startswith("CUDA IPC: ") for note in notes), notes
        return "ipc"
    assert stream.transport == "grpc", notes
    # The learner could not open the handles, or the server could not make them.
    assert any("could not open the server's CUDA IPC ring" in note
               or "the server could not make a CUDA IPC ring" in note for note in notes), notes
    print(f"CUDA IPC refused on this machine; host copies: {notes}")
    return "refused"


def _check(batch, first: int) -> None:
    frame = batch.data["frame"]
    assert frame.is_cuda and batch.ids.is_cuda and batch.weights.is_cuda
    assert torch.equal(frame[:, 0, 0, 0], (batch.data["row"] % 251).to(torch.uint8))
    assert torch.equal(frame[:, 3, 83, 83], frame[:, 0, 0, 0])
    assert torch.equal(batch.ids, first + batch.data["row"])


def test_batches_arrive_on_the_gpu_with_the_tables_rows_and_no_host_copy(served):
    client, first, _ = served
    stream = client.stream("g", 256, device="cuda", num_batches=40, prefetch=2,
                           batches_per_message=1, wait_timeout=60)
    count = 0
    settled = None  # the copies after 10 batches: the offer's first batch, and those
    for batch in stream:  # drawn before the learner accepted it, came as gRPC messages
        _check(batch, first)
        count += 1
        if count == 10:
            settled = (stream.stats.pinned_copies, stream.stats.pageable_copies,
                       stream.stats.resident)
    assert count == 40 and settled is not None
    if _outcome(stream) == "ipc":  # views of the ring from then on: nothing copied
        stats = stream.stats
        assert (stats.pinned_copies, stats.pageable_copies) == settled[:2], (stats, settled)
        assert stats.resident == settled[2] + 30 and settled[2] >= 10 - 3  # prefetch 2


def test_the_ring_is_not_overwritten_under_a_slower_gpu_consumer(served):
    """Each batch is read twice on the learner's stream, before and after ~5 ms of GPU
    sleep; with 2 slots and a server far faster than that consumer, a slot rewritten
    before the learner's stream released it would differ between the two reads."""
    client, first, _ = served
    stream = client.stream("g", 256, device="cuda", num_batches=30, prefetch=1,
                           batches_per_message=1, wait_timeout=60)
    early, late, rows = [], [], []
    for batch in stream:
        early.append(batch.ids.clone())
        rows.append(batch.data["row"].clone())
        torch.cuda._sleep(10_000_000)  # ~5 ms of GPU time on the learner's stream
        late.append(batch.ids.clone())
    torch.cuda.synchronize()
    assert len(early) == 30
    for a, b, row in zip(early, late, rows):
        assert torch.equal(a, b), "a slot was rewritten while the learner still used it"
        assert torch.equal(a, first + row)
    outcome = _outcome(stream)
    print(f"slow consumer through {stream.transport} ({outcome})")


def test_a_host_copy_stream_of_the_same_table_agrees(served):
    """The fallback path (asked not to use same-host transports) still gives the rows."""
    client, first, _ = served
    stream = client.stream("g", 256, device="cuda", num_batches=5, shared_memory=False,
                           batches_per_message=1, wait_timeout=60)
    for batch in stream:
        _check(batch, first)
    assert stream.transport == "grpc"
