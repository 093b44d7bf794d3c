"""SampleStream through client.stream: counts, chunking, grouped batches, flow control, shutdown.

Host batches are views of the stream's reused ring (valid until the next
one is requested), so tests check each batch inside the loop.
"""

from __future__ import annotations

import os
import threading

import psutil
import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import stays, wait_for

CONFIG = """
[server]
max_message_mb = 2

[[tables]]
name = "rows"
capacity = 1000
seed = 1

[[tables]]
name = "frames"
capacity = 200
sampler = "prioritized"

[[tables]]
name = "seq"
capacity = 1000
sampler = "slice"
slice_len = 4
"""


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    from tests.conftest import start_server

    proc = start_server(tmp_path_factory.mktemp("stream"), CONFIG)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def issued(proc) -> dict[str, torch.Tensor]:
    """Each table's rows, inserted once: the ids insert returned, indexed by the ``row`` column."""
    client = ReplayClient(proc.address)
    return {
        "rows": client.insert("rows", {"row": torch.arange(1000),
                                       "x": torch.arange(1000).float()}),
        "frames": client.insert("frames", {"row": torch.arange(200), "frame": torch.arange(200).to(
            torch.uint8).view(200, 1, 1).expand(200, 84, 84).clone()}),
        "seq": client.insert("seq", {"row": torch.arange(1000),
                                     "episode": torch.arange(1000) // 100}),
    }


@pytest.fixture(scope="module")
def client(proc, issued):
    return ReplayClient(proc.address)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
@pytest.mark.parametrize("per_message", [1, 4, 7])
def test_num_batches_are_delivered_whole_and_match_their_ids(client, issued, per_message,
                                                            shared_memory):
    count = 0
    stream = client.stream("rows", 32, num_batches=10, batches_per_message=per_message,
                           shared_memory=shared_memory)
    for batch in stream:
        assert batch.batch_size == 32 and batch.data["x"].shape == (32,)
        assert torch.equal(issued["rows"][batch.data["row"]], batch.ids)
        assert torch.equal(batch.data["x"], batch.data["row"].float())
        assert torch.equal(batch.weights, torch.ones(32))
        count += 1
    assert count == 10
    # Grouped batches travel in gRPC messages; single ones take the ring on this host.
    assert stream.transport == ("shared_memory" if shared_memory and per_message == 1 else "grpc")


def test_grouping_raises_the_window_to_hold_a_group(client, proc):
    before = _sampled(client, "rows")
    stream = client.stream("rows", 8, prefetch=2, batches_per_message=4)
    with stream:
        next(stream)
        # The window holds two groups of 4: the learner has taken 1 batch, so 8 + 1 drawn at most.
        assert wait_for(lambda: _sampled(client, "rows") - before >= 8 * 8)
        assert stays(lambda: _sampled(client, "rows") - before <= 9 * 8)
        assert any("prefetch raised to 8" in n for n in stream.stats.notes)
        assert stream.transport == "grpc"


def test_grouped_batches_of_slices_keep_their_shape(client, issued):
    shapes = []
    for batch in client.stream("seq", 8, num_batches=6, batches_per_message=3):
        shapes.append(tuple(batch.ids.shape))
        assert torch.equal(issued["seq"][batch.data["row"]], batch.ids)
        assert bool((batch.data["episode"] == batch.data["episode"][:, :1]).all())
    assert shapes == [(8, 4)] * 6


def test_batches_bigger_than_the_message_limit_arrive_in_chunks(client, issued):
    # 150 frames of 7 KB = 1 MB per batch, above half the 2 MiB limit: 2 chunks per group at most
    for batch in client.stream("frames", 150, num_batches=3, batches_per_message=8):
        assert batch.data["frame"].shape == (150, 84, 84)
        assert torch.equal(batch.data["frame"][:, 0, 0].long(), batch.data["row"])
        assert torch.equal(issued["frames"][batch.data["row"]], batch.ids)


def test_a_sample_over_the_message_limit_arrives_whole_as_a_stream_does(client):
    sampled = client.sample("frames", 400)  # over max_message_mb: SampleChunks
    batch = next(iter(client.stream("frames", 400, num_batches=1)))
    assert sampled.batch_size == batch.batch_size == 400


def test_breaking_out_of_an_endless_stream_cancels_it(client):
    for n, _ in enumerate(client.stream("rows", 16, batches_per_message=2)):
        if n == 20:
            break
    assert client.info()["rows"].size == 1000  # the server serves on


def test_negative_batches_per_message_is_invalid(client):
    with pytest.raises(errors.InvalidArgumentError, match="batches_per_message must be an integer >= 0"):
        next(iter(client.stream("rows", 4, batches_per_message=-1)))


def test_errors_reach_the_consumer_typed(client):
    with pytest.raises(errors.UnknownTableError):
        next(iter(client.stream("nope", 4)))


def _sampled(client, table):
    return client.info()[table].counters["sampled"]


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_the_server_runs_at_most_prefetch_batches_ahead(client, shared_memory):
    before = _sampled(client, "rows")
    stream = client.stream("rows", 16, prefetch=3, shared_memory=shared_memory)
    with stream:
        for _ in range(4):
            next(stream)
        # The learner holds batch 3 and has room for 3 more: exactly 7 batches drawn, no more.
        assert wait_for(lambda: _sampled(client, "rows") - before >= 7 * 16)
        assert stays(lambda: _sampled(client, "rows") - before == 7 * 16)
        next(stream)
        assert wait_for(lambda: _sampled(client, "rows") - before == 8 * 16)


def test_memory_does_not_grow_while_streaming(client):
    proc = psutil.Process()
    stream = client.stream("frames", 150, prefetch=2)  # about 1 MB per batch
    with stream:
        for _ in range(30):
            next(stream)
        warm = proc.memory_info().rss
        for _ in range(300):
            next(stream)
        grown = proc.memory_info().rss - warm
    assert grown < 16 * 2**20, f"resident memory grew by {grown >> 20} MiB over 300 batches"


def _stream_threads():
    return [t for t in threading.enumerate() if t.name.startswith("replay-stream")]


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_break_stops_the_background_thread_and_frees_shared_memory(client, proc, shared_memory):
    for n, _ in enumerate(client.stream("frames", 64, shared_memory=shared_memory)):
        if n == 5:
            break
    assert wait_for(lambda: not _stream_threads(), timeout=10)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"replay-{proc.process.pid}-")]
    with client.stream("rows", 8) as stream:
        next(stream)
    assert wait_for(lambda: not _stream_threads(), timeout=10)


def test_a_server_error_mid_stream_reaches_the_learner_typed(client, tmp_path):
    from tests.conftest import start_server

    proc = start_server(tmp_path, CONFIG)
    try:
        other = ReplayClient(proc.address)
        other.insert("rows", {"row": torch.arange(10), "x": torch.zeros(10)})
        stream = other.stream("rows", 4, prefetch=1, wait=False)  # waiting: test_data_waits
        next(stream)
        other.reset("rows")
        with pytest.raises(errors.EmptyTableError, match="rows"):
            for _ in range(10):
                next(stream)
    finally:
        proc.stop()


def test_a_transform_error_reaches_the_learner_as_raised(client):
    def transform(batch):
        raise KeyError("no such key in the learner's transform")

    with pytest.raises(KeyError, match="learner's transform"):
        next(iter(client.stream("rows", 4, transform=transform)))


def test_transform_output_is_what_the_learner_receives(client, issued):
    def transform(batch):
        return {"obs": batch.data["x"] * 2, "ids": batch.ids, "w": batch.weights}

    row_of_id = {i: r for r, i in enumerate(issued["rows"].tolist())}
    for n, out in enumerate(client.stream("rows", 8, transform=transform, num_batches=3)):
        assert set(out) == {"obs", "ids", "w"}
        rows = torch.tensor([row_of_id[i] for i in out["ids"].tolist()])
        assert torch.equal(out["obs"], rows.float() * 2)
    assert n == 2


def test_pinning_and_device_options_are_checked_before_any_call(client):
    if torch.cuda.is_available():
        pytest.skip("checks the no-accelerator messages")
    with pytest.raises(errors.InvalidArgumentError, match="pin_memory=True needs an accelerator"):
        client.stream("rows", 8, pin_memory=True)
    with pytest.raises(errors.InvalidArgumentError, match="device='cuda'"):
        client.stream("rows", 8, device="cuda")
    with pytest.raises(errors.InvalidArgumentError, match="prefetch must be an integer >= 1"):
        client.stream("rows", 8, prefetch=0)
    with pytest.raises(errors.InvalidArgumentError, match="pin_memory must be"):
        client.stream("rows", 8, pin_memory="yes")
    stream = client.stream("rows", 8, num_batches=1)
    batch = next(stream)
    assert not stream.pinned and not batch.ids.is_pinned()
    assert "not pinned: no accelerator" in stream.stats.notes[0]
