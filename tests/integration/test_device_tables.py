"""A device table served by a real server process: every network path falls back to the host.

The server runs with the CPU stand-in for CUDA (``tests/integration/standin_server.py``),
so its ``device = "cuda"`` table runs the device storage's code on the CPU.
Its rows are not counted against the host memory budget: ``table_memory_mb = 1``
could never hold the table's 56 MB of rows on the host, so the first insert
would be refused for a host table. Over that server, inserts, unary
samples, the gRPC stream and the shared-memory stream, and priority updates
must all work and return the right rows. Without the stand-in, on this
machine without CUDA, a server with a device table refuses to start naming
the table and the device. The GPU version is ``tests/gpu/test_device_table.py``.
"""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import serve_until_exit, start_server

CONFIG = """
[server]
table_memory_mb = 1

[[tables]]
name = "g"
capacity = 2000
sampler = "prioritized"
device = "cuda"
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A client of a stand-in server holding rows 0..1999 (frame = row % 251), and the first id."""
    proc = start_server(tmp_path_factory.mktemp("device"), CONFIG,
                        module="tests.integration.standin_server")
    client = ReplayClient(proc.address)
    rows = torch.arange(2000)
    frames = (rows % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(2000, 4, 84, 84).clone()
    first = None
    for start in range(0, 2000, 250):  # 7 MB per insert
        ids = client.insert("g", {"row": rows[start:start + 250], "frame": frames[start:start + 250]})
        first = int(ids[0]) if first is None else first
    yield client, first
    client.close()
    proc.stop()


def _check(batch, first_id: int) -> None:
    assert batch.data["frame"].device.type == "cpu"
    assert torch.equal(batch.data["frame"][:, 0, 0, 0], (batch.data["row"] % 251).to(torch.uint8))
    assert torch.equal(batch.data["frame"][:, 3, 83, 83], batch.data["frame"][:, 0, 0, 0])
    assert torch.equal(batch.ids, first_id + batch.data["row"])  # consecutive ids


def test_unary_samples_and_priority_updates(served):
    client, first = served
    batch = client.sample("g", 64)
    _check(batch, first)
    assert client.update_priorities("g", batch.ids, torch.full((64,), 5.0)) == 64
    assert client.info()["g"].size == 2000


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_streams_over_both_transports(served, shared_memory):
    client, first = served
    stream = client.stream("g", 32, num_batches=6, shared_memory=shared_memory,
                           batches_per_message=1)  # the shared-memory ring carries one per slot
    count = 0
    for batch in stream:
        _check(batch, first)
        count += 1
    assert count == 6
    assert stream.transport == ("shared_memory" if shared_memory else "grpc"), stream.stats.notes


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a CUDA device")
def test_without_cuda_a_device_table_stops_the_server_at_start(tmp_path):
    code, output = serve_until_exit(tmp_path, CONFIG)
    assert code != 0
    assert "table 'g': device = 'cuda' but this machine has no CUDA device" in output
