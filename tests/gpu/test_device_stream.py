"""The learner's device path on a real GPU (skipped where CUDA is absent, e.g. CI).

Run with ``make test`` on a machine with CUDA: batches land on the device,
every device copy reads pinned memory (checked while the stream is live,
through ``stream.stats``), with and without a transform, and a learner with a
fixed GPU step is not starved (:mod:`tests.gpu.test_starvation`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from replay_client import ReplayClient  # noqa: E402
from replay_feed.accelerator import CudaAccelerator  # noqa: E402
from replay_feed import BatchStream, FeedCore, resolve_delivery  # noqa: E402
from replay_server import Table, TableConfig  # noqa: E402
from replay_feed.source import LinkSource  # noqa: E402
from replay_server.app.embedded import TableLink  # noqa: E402

CONFIG = """
[[tables]]
name = "frames"
capacity = 2000
sampler = "prioritized"
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A client of a server holding rows 0..1999 (frame = row % 251), and the first row's id."""
    from tests.conftest import start_server

    proc = start_server(tmp_path_factory.mktemp("gpu"), CONFIG)
    client = ReplayClient(proc.address)
    rows = torch.arange(2000)
    frames = (rows % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(2000, 4, 84, 84).clone()
    ids = client.insert("frames", {"row": rows, "frame": frames})
    yield client, int(ids[0])
    client.close()
    proc.stop()


def _copies_were_pinned(stream) -> bool:
    """While the stream is live: every device copy so far read page-locked host memory."""
    stats = stream.stats
    return stats.pinned_copies >= stats.batches >= 1 and stats.pageable_copies == 0


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_batches_arrive_on_the_device_from_pinned_staging(served, shared_memory):
    client, first_id = served
    stream = client.stream("frames", 64, device="cuda", num_batches=20, shared_memory=shared_memory)
    assert stream.pinned
    for batch in stream:
        assert batch.data["frame"].is_cuda and batch.ids.is_cuda and batch.weights.is_cuda
        expected = (batch.data["row"] % 251).to(torch.uint8)
        assert torch.equal(batch.data["frame"][:, 0, 0, 0], expected)
        assert torch.equal(batch.ids, first_id + batch.data["row"])  # one insert: consecutive ids
        assert _copies_were_pinned(stream)
    assert stream.stats.batches == 20
    assert stream.transport == ("shared_memory" if shared_memory else "grpc")
    if shared_memory:
        assert any("pinned in place" in n or "pinned staging" in n for n in stream.stats.notes)


def test_transform_output_is_pinned_before_the_copy(served):
    client, _ = served
    pinned = []

    def transform(batch):
        return {"x": batch.data["frame"].float() / 255, "row": batch.data["row"]}

    stream = client.stream("frames", 32, pin_memory=True, transform=transform, num_batches=5)
    for out in stream:
        pinned.append(out["x"].is_pinned() and out["row"].is_pinned())
    assert all(pinned)
    stream = client.stream("frames", 32, device="cuda", transform=transform, num_batches=5)
    for out in stream:
        assert out["x"].is_cuda
        assert torch.allclose(out["x"][:, 0, 0, 0] * 255, (out["row"] % 251).float())
        assert _copies_were_pinned(stream)


def test_embedded_storage_is_pinned_and_feeds_the_device():
    from replay_server.app.embedded import EmbeddedServer
    from replay_server.app.config_file import settings_from_dict

    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"},
                                   "tables": [{"name": "r", "capacity": 500}]})
    with EmbeddedServer(settings, listen=False) as server:
        ids = server.tables["r"].insert({"row": torch.arange(500)}).cuda()
        info = server.tables["r"].info()
        assert info.pinned and info.pinned_bytes == info.storage_bytes > 0  # all of it
        stream = server.stream("r", 64, device="cuda", num_batches=5)
        for batch in stream:
            assert batch.data["row"].is_cuda and torch.equal(ids[batch.data["row"]], batch.ids)
            assert _copies_were_pinned(stream)
        assert stream.stats.batches == 5


def test_an_in_process_stream_fills_pinned_staging_in_order():
    table = Table(TableConfig(name="frames", capacity=2000, sampler="uniform"))
    rows = torch.arange(2000)
    ids = table.insert({"row": rows, "frame": (rows % 251).to(torch.uint8).view(-1, 1, 1, 1)
                        .expand(2000, 4, 84, 84).clone()}).cuda()
    core = FeedCore(2, resolve_delivery("cuda", True, accelerator=CudaAccelerator()))
    stream = BatchStream(core, LinkSource(TableLink(table, 256, core.staging), num_batches=30),
                         "frames")
    for batch in stream:  # the producer overwrites staging slots while earlier copies may run
        assert torch.equal(ids[batch.data["row"]], batch.ids)
        assert torch.equal(batch.data["frame"][:, :, 0, 0].long(), (batch.data["row"] % 251)
                           .view(-1, 1).expand(256, 4))
        assert _copies_were_pinned(stream)
    assert stream.stats.batches == 30
