"""The learner's device path on a real GPU (skipped where CUDA is absent, e.g. CI).

Run with ``make test`` on a machine with CUDA: batches land on the device,
staging is pinned with and without a transform, and the copy of batch k+1
overlaps the learner's compute on batch k (timed with CUDA events).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from replay_client import ReplayClient  # noqa: E402
from replay_feed.accelerator import CudaAccelerator  # noqa: E402
from replay_feed import BatchStream, FeedCore, resolve_delivery  # noqa: E402
from replay_server import Table, TableConfig  # noqa: E402
from replay_server.app.embedded import TableSource  # noqa: E402

CONFIG = """
[[tables]]
name = "frames"
capacity = 2000
sampler = "prioritized"
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tests.conftest import start_server

    proc = start_server(tmp_path_factory.mktemp("gpu"), CONFIG)
    client = ReplayClient(proc.address)
    rows = torch.arange(2000)
    client.insert("frames", {"row": rows, "frame": (rows % 251).to(torch.uint8).view(-1, 1, 1, 1)
                             .expand(2000, 4, 84, 84).clone()})
    yield client
    proc.stop()


def _staging_pinned(stream) -> bool:
    buffers = [b for slot in stream._core._staging._buffers if slot for b in slot]
    return bool(buffers) and all(b.is_pinned() for b in buffers)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_batches_arrive_on_the_device_from_pinned_staging(client, shared_memory):
    stream = client.stream("frames", 64, device="cuda", num_batches=20, shared_memory=shared_memory)
    for batch in stream:
        assert batch.data["frame"].is_cuda and batch.ids.is_cuda and batch.weights.is_cuda
        expected = (batch.ids % 251).to(torch.uint8)
        assert torch.equal(batch.data["frame"][:, 0, 0, 0], expected)
    assert stream.pinned
    if shared_memory:
        assert stream.transport == "shared_memory"
        assert any("pinned in place" in n or "pinned staging" in n for n in stream.stats.notes)
    else:
        assert _staging_pinned(stream) or stream.transport == "shared_memory"


def test_transform_output_is_pinned_before_the_copy(client):
    pinned = []

    def transform(batch):
        out = {"x": batch.data["frame"].float() / 255, "ids": batch.ids}
        return out

    stream = client.stream("frames", 32, pin_memory=True, transform=transform, num_batches=5)
    for out in stream:
        pinned.append(out["x"].is_pinned() and out["ids"].is_pinned())
    assert all(pinned)
    for out in client.stream("frames", 32, device="cuda", transform=transform, num_batches=5):
        assert out["x"].is_cuda
        assert torch.allclose(out["x"][:, 0, 0, 0] * 255, (out["ids"] % 251).float())


class TimedCuda(CudaAccelerator):
    """Records when each device copy starts and ends on its side stream."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def copy(self, tensors, device):
        stream = self._side_stream(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        out, _ = super().copy(tensors, device)
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self.copies.append((start, end))
        return out, end


def test_the_copy_of_the_next_batch_overlaps_compute_on_this_one():
    table = Table(TableConfig(name="frames", capacity=2000, sampler="uniform", pin_memory=True))
    table.insert({"frame": torch.randint(0, 255, (2000, 4, 84, 84), dtype=torch.uint8)})
    accel = TimedCuda()
    core = FeedCore(1, resolve_delivery("cuda", True, accelerator=accel))
    stream = BatchStream(core, TableSource(table, 256, 30), "frames")
    weight = torch.randn(2048, 2048, device="cuda")
    base = torch.cuda.Event(enable_timing=True)
    base.record()
    computes = []
    for batch in stream:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        y = weight * batch.data["frame"].float().mean()
        for _ in range(40):  # a few milliseconds of learner compute
            y = torch.tanh(y @ weight)
        end.record()
        computes.append((start, end))
    torch.cuda.synchronize()
    t = lambda event: base.elapsed_time(event)  # noqa: E731
    overlapping = sum(
        1 for k in range(len(computes) - 1)
        if t(accel.copies[k + 1][0]) < t(computes[k][1]) and t(accel.copies[k + 1][1]) > t(computes[k][0])
    )
    assert overlapping >= 0.8 * (len(computes) - 1), (overlapping, len(computes))


def test_embedded_storage_is_pinned_and_feeds_the_device():
    from replay_server.app.embedded import EmbeddedServer
    from replay_server.app.config_file import settings_from_dict

    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"},
                                   "tables": [{"name": "r", "capacity": 500}]})
    with EmbeddedServer(settings, listen=False) as server:
        server.tables["r"].insert({"row": torch.arange(500)})
        assert server.tables["r"].info().pinned
        stream = server.stream("r", 64, device="cuda", num_batches=5)
        for batch in stream:
            assert batch.data["row"].is_cuda and torch.equal(batch.data["row"], batch.ids)
        assert _staging_pinned(stream)
