"""Device tables on a real GPU (skipped where CUDA is absent, e.g. CI).

The CPU versions of these tests drive the same code through the stand-in
(``tests/server/engine/storage/test_device.py``, ``tests/server/checkpoint/
test_device_tables.py``, ``tests/server/app/test_device_table_stream.py``,
``tests/integration/test_device_tables.py``). Here the columns are really in
device memory: a ``device = "cuda"`` table samples exactly as a host table
(prioritized, with updates), checkpoints and restores, streams in process
with no host copy, and serves unary samples and both network streams
through the host fallback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from replay_client import ReplayClient  # noqa: E402
from replay_server import TableConfig, TableSet  # noqa: E402
from replay_server.app.config_file import settings_from_dict  # noqa: E402
from replay_server.app.embedded import EmbeddedServer  # noqa: E402
from replay_server.checkpoint import (  # noqa: E402
    CheckpointDirectory,
    load_checkpoint,
    write_checkpoint,
)
from replay_server.engine.storage.device import DeviceColumn  # noqa: E402
from replay_server.engine.table import Table  # noqa: E402

ROWS = 2000


def _rows(start: int, n: int) -> dict[str, torch.Tensor]:
    row = torch.arange(start, start + n)
    return {"row": row,
            "frame": (row % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(n, 4, 84, 84).clone(),
            "half": row.to(torch.bfloat16).unsqueeze(1)}


def _check(batch, first_id: int, device: str) -> None:
    frame = batch.data["frame"]
    assert frame.device.type == device and batch.ids.device.type == device
    assert torch.equal(frame[:, 0, 0, 0], (batch.data["row"] % 251).to(torch.uint8))
    assert torch.equal(frame[:, 3, 83, 83], frame[:, 0, 0, 0])
    assert torch.equal(batch.ids.cpu(), first_id + batch.data["row"].cpu())


def test_a_cuda_table_samples_exactly_as_a_host_table_with_priority_updates():
    device = Table(TableConfig(name="t", capacity=700, sampler="prioritized", seed=1,
                               device="cuda"))
    host = Table(TableConfig(name="t", capacity=700, sampler="prioritized", seed=1))
    generator = torch.Generator().manual_seed(0)
    for step in range(12):  # 1,200 rows into 700 slots: wraps
        rows = _rows(step * 100, 100)
        assert torch.equal(device.insert(rows), host.insert(rows))
        got, want = device.sample(256), host.sample(256)
        assert all(t.is_cuda for t in got.tensors())
        for a, b in zip(got.tensors(), want.tensors()):
            assert torch.equal(a.cpu(), b)
        priorities = torch.rand(256, generator=generator) * 4
        assert device.update_priorities(got.ids, priorities.cuda()) == host.update_priorities(
            want.ids, priorities)
    storage = device._parts.storage
    assert all(isinstance(c, DeviceColumn) for c in storage.columns.values())
    assert all(c.tensor.is_cuda for c in storage.columns.values())


def test_a_cuda_table_checkpoints_and_restores_on_the_device(tmp_path: Path):
    configs = [TableConfig(name="g", capacity=300, sampler="prioritized", seed=2, device="cuda")]
    tables = TableSet(configs)
    for start in range(0, 500, 50):
        tables["g"].insert(_rows(start, 50))
    directory = CheckpointDirectory(tmp_path / "ckpt")
    directory.open()
    try:
        result = write_checkpoint(tables, directory, keep_latest=2, server_version="test",
                                  chunk_bytes=1 << 20)
        restored = TableSet(configs)
        load_checkpoint(result.path, restored)
    finally:
        directory.close()
    assert all(c.tensor.is_cuda for c in restored["g"]._parts.storage.columns.values())
    for a, b in zip(restored["g"].sample(64).tensors(), tables["g"].sample(64).tensors()):
        assert torch.equal(a, b)


CONFIG = {"server": {"address": "127.0.0.1:0"},
          "tables": [{"name": "g", "capacity": ROWS, "sampler": "prioritized",
                      "device": "cuda"}]}


@pytest.fixture(scope="module")
def embedded():
    with EmbeddedServer(settings_from_dict(CONFIG)) as server:
        client = ReplayClient(server.address)
        first = None
        for start in range(0, ROWS, 250):
            ids = client.insert("g", _rows(start, 250))
            first = int(ids[0]) if first is None else first
        yield server, client, first
        client.close()


def test_the_embedded_stream_of_a_cuda_table_makes_no_host_copy(embedded):
    server, _, first = embedded
    stream = server.stream("g", 256, device="cuda", num_batches=30)
    for batch in stream:
        _check(batch, first, "cuda")
        assert batch.weights.is_cuda and batch.probabilities.is_cuda
        stats = stream.stats  # checked while the stream is live
        assert stats.resident >= stats.batches >= 1
        assert stats.pinned_copies == stats.pageable_copies == 0
    assert stream.stats.resident == 30


def test_unary_samples_and_updates_of_a_cuda_table_come_through_the_host(embedded):
    _, client, first = embedded
    batch = client.sample("g", 64)
    _check(batch, first, "cpu")
    assert client.update_priorities("g", batch.ids, torch.full((64,), 3.0)) == 64


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_network_streams_of_a_cuda_table_fall_back_to_the_host(embedded, shared_memory):
    _, client, first = embedded
    stream = client.stream("g", 64, device="cuda", num_batches=10, shared_memory=shared_memory,
                           batches_per_message=1)
    for batch in stream:
        _check(batch, first, "cuda")  # copied to host once by the server, to cuda by the feed
    assert stream.transport == ("shared_memory" if shared_memory else "grpc")


def test_cuda_rows_inserted_in_process_go_straight_into_a_cuda_table(monkeypatch):
    """Rows made on the GPU (a GPU-simulated environment) are stored without a host round trip."""
    table = Table(TableConfig(name="t", capacity=500, sampler="slice", slice_len=4, seed=3,
                              device="cuda"))
    host_copies = []
    original = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        if self.numel() > 500:  # a column of rows, not the episode ids the sampler reads
            host_copies.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    rows = {key: value.cuda() for key, value in _rows(0, 400).items()}
    rows["episode"] = (torch.arange(400) // 50).cuda()
    table.insert(rows)
    assert host_copies == []
    batch = table.sample(32)
    first = batch.data["row"][:, 0]
    assert torch.equal(batch.data["row"], first.unsqueeze(1) + torch.arange(4, device="cuda"))
