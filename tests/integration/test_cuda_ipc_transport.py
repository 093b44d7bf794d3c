"""CUDA IPC's protocol between a real server process and a learner, through a simulated device.

The server (``tests/integration/ipc_standin_server.py``) runs its ``device =
"cuda"`` table on the CPU stand-in and the CUDA IPC transport's device
operations on :class:`~tests.integration.simulated_ipc.SimulatedIpc`: slots
are /dev/shm files both processes map, events are shared counters whose
waits check the ordering a GPU would enforce (a slot rewritten before the
learner released it, or read before it was written, fails the stream). The
learner (this process) installs the same simulation. Checked: the offer is
made and accepted only when it should be (a device table, this host, the
learner sees the table's GPU, within ``server.shared_memory_mb``), batches are
the table's rows, ring slots are reused only after release, and every
refusal falls back (host copies over gRPC, or the shared-memory ring) with
the reason in ``stream.stats.notes``. The GPU version is ``tests/gpu/test_cuda_ipc.py``.
"""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient
from replay_client import cuda_ipc_source, ring_source
from replay_client.errors import InternalError
from replay_feed import device_ipc
from tests.conftest import start_server
from tests.integration.simulated_ipc import SimulatedIpc

CONFIG = """
[server]
table_memory_mb = 64

[[tables]]
name = "g"
capacity = 1000
sampler = "prioritized"
device = "cuda"

[[tables]]
name = "h"
capacity = 1000
"""

ROWS = 1000


def _rows(start: int, n: int, side: int = 16) -> dict[str, torch.Tensor]:
    row = torch.arange(start, start + n)
    return {"row": row,
            "frame": (row % 251).to(torch.uint8).view(-1, 1, 1).expand(n, side, side).clone()}


def _fill(client: ReplayClient, table: str, side: int = 16) -> int:
    first = None
    for start in range(0, ROWS, 250):
        ids = client.insert(table, _rows(start, 250, side))
        first = int(ids[0]) if first is None else first
    assert first is not None
    return first


def _check(batch, first_id: int) -> None:
    frame = batch.data["frame"]
    assert torch.equal(frame[:, 0, 0], (batch.data["row"] % 251).to(torch.uint8))
    assert torch.equal(frame[:, 15, 15], frame[:, 0, 0])
    assert torch.equal(batch.ids, first_id + batch.data["row"])  # consecutive ids


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A client of a server with a device table "g" and a host table "h", both full."""
    proc = start_server(tmp_path_factory.mktemp("cuda_ipc"), CONFIG,
                        module="tests.integration.ipc_standin_server")
    client = ReplayClient(proc.address)
    firsts = {"g": _fill(client, "g"), "h": _fill(client, "h")}
    yield client, firsts, proc
    client.close()
    proc.stop()


@pytest.fixture
def sim(monkeypatch):
    """This process's device IPC: the simulation (restored after the test)."""
    ipc = SimulatedIpc()
    monkeypatch.setattr(device_ipc, "_BACKEND", ipc)
    return ipc


def _stream(client, table, n=24, prefetch=2):
    return client.stream(table, 32, num_batches=n, prefetch=prefetch, batches_per_message=1)


def test_a_device_table_streams_through_the_ring_reusing_slots_only_after_release(served, sim):
    client, firsts, _ = served
    stream = _stream(client, "g")  # 24 batches through 3 slots: each slot reused 7 times
    seen = 0
    for batch in stream:
        _check(batch, firsts["g"])
        assert batch.ids.shape == (32,)
        seen += 1
    assert seen == 24
    assert stream.transport == "cuda_ipc", stream.stats.notes
    assert any(note.startswith("CUDA IPC: 3 slots") for note in stream.stats.notes)
    assert sim.opened == 3 * 3  # 3 buffers, 3 written and 3 released events


def test_a_learner_that_never_releases_its_slots_fails_the_ring_check(served, sim, monkeypatch):
    """The ordering check is real: without the learner's released events, the server's
    wait before rewriting a slot fails, and so does the stream."""
    client, _, proc = served
    monkeypatch.setattr(sim, "record", lambda event, device: None)  # learner records nothing
    stream = _stream(client, "g", n=12, prefetch=1)
    with pytest.raises(InternalError):
        for _ in stream:
            pass
    assert "OrderingError: simulated IPC: wait 1 on" in proc.log()


def test_handles_that_cannot_be_opened_fall_back_to_host_copies(served, sim):
    client, firsts, _ = served
    sim.refuse = True
    stream = _stream(client, "g")
    count = 0
    for batch in stream:
        _check(batch, firsts["g"])
        count += 1
    assert count == 24
    assert stream.transport == "grpc", stream.stats.notes
    assert any("could not open the server's CUDA IPC ring" in note and "refused" in note
               for note in stream.stats.notes), stream.stats.notes


def test_a_learner_that_does_not_see_the_tables_gpu_gets_the_shared_memory_ring(served,
                                                                                 monkeypatch):
    client, firsts, _ = served
    monkeypatch.setattr(device_ipc, "_BACKEND", SimulatedIpc(devices=("SIM-GPU-7",)))
    stream = _stream(client, "g", n=6)
    for batch in stream:
        _check(batch, firsts["g"])
    assert stream.transport == "shared_memory", stream.stats.notes


def test_a_learner_on_another_host_gets_host_copies(served, sim, monkeypatch):
    client, firsts, _ = served
    monkeypatch.setattr(cuda_ipc_source, "host_id", lambda: "another-host")
    monkeypatch.setattr(ring_source, "host_id", lambda: "another-host")
    stream = _stream(client, "g", n=6)
    for batch in stream:
        _check(batch, firsts["g"])
    assert stream.transport == "grpc"
    assert any("no CUDA IPC: the learner runs on another host" in note
               for note in stream.stats.notes), stream.stats.notes
    assert sim.opened == 0


def test_a_host_table_is_not_offered_cuda_ipc(served, sim):
    client, firsts, _ = served
    stream = _stream(client, "h", n=6)
    for batch in stream:
        _check(batch, firsts["h"])
    assert stream.transport == "shared_memory", stream.stats.notes
    assert sim.opened == 0


def test_a_learner_that_does_not_ask_gets_the_shared_memory_ring(served):
    """Without the simulation this process's backend is CUDA's, and host delivery is not
    CUDA: the learner does not ask, the ring carries the device table's host copies."""
    client, firsts, _ = served
    stream = _stream(client, "g", n=6)
    for batch in stream:
        _check(batch, firsts["g"])
    assert stream.transport == "shared_memory", stream.stats.notes


def test_a_ring_over_the_budget_is_refused_naming_the_setting(tmp_path, sim):
    config = CONFIG.replace("table_memory_mb = 64", "table_memory_mb = 64\nshared_memory_mb = 1")
    proc = start_server(tmp_path, config, module="tests.integration.ipc_standin_server")
    try:
        client = ReplayClient(proc.address)
        first = _fill(client, "g", side=128)  # 16 KiB rows
        stream = client.stream("g", 32, num_batches=4, prefetch=2, batches_per_message=1)
        for batch in stream:  # 3 slots of 32 rows of 16 KiB: 1.5 MiB, over 1 MiB
            _check(batch, first)
        assert stream.transport == "grpc", stream.stats.notes
        assert any("no CUDA IPC ring" in note and "server.shared_memory_mb" in note
                   for note in stream.stats.notes), stream.stats.notes
        assert sim.opened == 0
        client.close()
    finally:
        proc.stop()


def test_a_server_that_cannot_export_handles_falls_back_to_host_copies(tmp_path, sim):
    """Each stream is refused for the export, with the reason, and reads host copies."""
    config = CONFIG
    proc = start_server(tmp_path, config, module="tests.integration.ipc_standin_server",
                        env={"REPLAY_SIM_IPC_REFUSE_EXPORT": "1"})
    try:
        client = ReplayClient(proc.address)
        first = _fill(client, "g", side=128)  # 16 KiB rows: 3 slots of 16 rows
        for _ in range(3):
            stream = client.stream("g", 16, num_batches=6, prefetch=2, batches_per_message=1)
            for batch in stream:
                _check(batch, first)
            assert stream.transport == "grpc", stream.stats.notes
            assert any("the server could not make a CUDA IPC ring" in note
                       for note in stream.stats.notes), stream.stats.notes
        assert sim.opened == 0
        client.close()
    finally:
        proc.stop()
