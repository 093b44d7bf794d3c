"""SampleStream through client.stream: counts, chunking, grouped batches, cancellation."""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient, errors

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
def client(tmp_path_factory):
    from tests.conftest import start_server

    proc = start_server(tmp_path_factory.mktemp("stream"), CONFIG)
    client = ReplayClient(proc.address)
    client.insert("rows", {"row": torch.arange(1000), "x": torch.arange(1000).float()})
    client.insert("frames", {"row": torch.arange(200),
                             "frame": torch.arange(200).to(torch.uint8).view(200, 1, 1).expand(200, 84, 84).clone()})
    client.insert("seq", {"row": torch.arange(1000), "episode": torch.arange(1000) // 100})
    yield client
    proc.stop()


@pytest.mark.parametrize("per_message", [1, 4, 7])
def test_num_batches_are_delivered_whole_and_match_their_ids(client, per_message):
    batches = list(client.stream("rows", 32, num_batches=10, batches_per_message=per_message))
    assert len(batches) == 10
    for batch in batches:
        assert batch.batch_size == 32 and batch.data["x"].shape == (32,)
        assert torch.equal(batch.data["row"], batch.ids)


def test_grouped_batches_of_slices_keep_their_shape(client):
    batches = list(client.stream("seq", 8, num_batches=6, batches_per_message=3))
    assert [b.ids.shape for b in batches] == [(8, 4)] * 6
    for batch in batches:
        assert torch.equal(batch.data["row"], batch.ids)
        assert bool((batch.data["episode"] == batch.data["episode"][:, :1]).all())


def test_batches_bigger_than_the_message_limit_arrive_in_chunks(client):
    # 150 frames of 7 KB = 1 MB per batch, above half the 2 MiB limit: 2 chunks per group at most
    for batch in client.stream("frames", 150, num_batches=3, batches_per_message=8):
        assert batch.data["frame"].shape == (150, 84, 84)
        assert torch.equal(batch.data["frame"][:, 0, 0].long(), batch.ids)
        assert torch.equal(batch.data["row"], batch.ids)


def test_a_unary_sample_over_the_limit_is_refused_but_streams(client):
    with pytest.raises(errors.MessageTooLargeError, match="client.stream"):
        client.sample("frames", 400)
    batch = next(iter(client.stream("frames", 400, num_batches=1)))
    assert batch.batch_size == 400


def test_breaking_out_of_an_endless_stream_cancels_it(client):
    for n, _ in enumerate(client.stream("rows", 16, batches_per_message=2)):
        if n == 20:
            break
    assert client.info()["rows"].size == 1000  # the server serves on


def test_negative_batches_per_message_is_invalid(client):
    with pytest.raises(errors.InvalidArgumentError, match="batches_per_message must be >= 0"):
        next(iter(client.stream("rows", 4, batches_per_message=-1)))


def test_errors_reach_the_consumer_typed(client):
    with pytest.raises(errors.UnknownTableError):
        next(iter(client.stream("nope", 4)))
