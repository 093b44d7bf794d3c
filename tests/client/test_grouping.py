"""client.stream chooses batches per message from the batch size when the learner does not."""

from __future__ import annotations

import torch

from replay_client import ReplayClient
from replay_client import grouping
from tests.conftest import module_server, stays, wait_for

CONFIG = """
[[tables]]
name = "rows"
capacity = 5000
sampler = "prioritized"

[[tables]]
name = "frames"
capacity = 400
sampler = "uniform"

[[tables]]
name = "empty"
capacity = 10
sampler = "uniform"
"""

server = module_server(CONFIG)


def test_small_batches_are_grouped_up_to_the_cap_and_the_window_holds_two_groups():
    chosen = grouping.choose(23 * 1024, None)
    assert (chosen.batches_per_message, chosen.prefetch) == (8, 16)
    assert "batches_per_message=8" in chosen.note


def test_a_shards_chunks_group_up_to_the_rows_one_servers_message_carries():
    """A sharded stream's shard sends chunks of a batch: up to ``most`` of them per message,
    still within the target bytes."""
    chosen = grouping.choose(12 * 1024, None, most=16)
    assert (chosen.batches_per_message, chosen.prefetch) == (16, 32)
    assert grouping.choose(512 * 1024, None, most=16).batches_per_message == 4


def test_a_group_fills_about_the_target_bytes():
    chosen = grouping.choose(512 * 1024, None)
    assert (chosen.batches_per_message, chosen.prefetch) == (4, 8)


def test_large_or_unknown_batches_are_not_grouped():
    for size in (grouping.GROUP_BELOW_BYTES + 1, None):
        chosen = grouping.choose(size, None)
        assert (chosen.batches_per_message, chosen.prefetch, chosen.note) == (1, 2, "")
    assert grouping.choose(None, 5).prefetch == 5


def test_a_given_prefetch_stays_the_bound_and_groups_shrink_to_fit_two():
    assert grouping.choose(1024, 6).batches_per_message == 3
    assert grouping.choose(1024, 6).prefetch == 6
    assert grouping.choose(1024, 3).batches_per_message == 1


def test_a_given_group_widens_the_window_to_two_groups_and_says_so_only_when_raised():
    assert grouping.given(4, 2) == grouping.Grouping(
        8, 4, "prefetch raised to 8: two groups of batches_per_message=4 fit the window")
    assert grouping.given(4, None) == grouping.Grouping(8, 4)  # the default window: no note
    assert grouping.given(4, 10) == grouping.Grouping(10, 4)  # two groups fit already


def test_no_group_given_keeps_the_window_and_one_batch_per_message():
    for given in (None, 1):
        assert grouping.given(given, None) == grouping.Grouping(grouping.DEFAULT_PREFETCH, 1)
        assert grouping.given(given, 3) == grouping.Grouping(3, 1)


def _sampled(client: ReplayClient, table: str) -> int:
    return client.info()[table].counters["sampled"]


def test_a_plain_stream_of_small_rows_is_grouped_and_bounded(server):
    client = ReplayClient(server.address)
    client.insert("rows", {"obs": torch.randn(1000, 17)})
    before = _sampled(client, "rows")
    with client.stream("rows", 32) as stream:
        for _ in range(3):
            next(stream)
        # chosen at the first batch: 8 per message, and the window widened to two groups
        assert any("batches_per_message=8" in note for note in stream.stats.notes)
        # Three taken, and a window of 16 (two groups of 8): never more than 19 drawn.
        assert wait_for(lambda: _sampled(client, "rows") - before >= 16 * 32)
        assert stays(lambda: _sampled(client, "rows") - before <= 19 * 32)
        assert stream.transport == "grpc"


def test_a_given_prefetch_bounds_a_grouped_stream(server):
    client = ReplayClient(server.address)
    client.insert("rows", {"obs": torch.randn(1000, 17)})
    before = _sampled(client, "rows")
    with client.stream("rows", 32, prefetch=4) as stream:
        for _ in range(3):
            next(stream)
        assert any("batches_per_message=2" in note for note in stream.stats.notes)
        assert wait_for(lambda: _sampled(client, "rows") - before >= 7 * 32)
        assert stays(lambda: _sampled(client, "rows") - before == 7 * 32)


def test_large_batches_are_not_grouped(server):
    client = ReplayClient(server.address)
    client.insert("frames", {"pixels": torch.zeros(400, 84, 84, 4, dtype=torch.uint8)})
    with client.stream("frames", 256, num_batches=2) as stream:  # 7 MB batches
        assert sum(1 for _ in stream) == 2
        assert not any("batches_per_message" in note for note in stream.stats.notes)


def test_a_learner_that_starts_before_the_first_insert_is_grouped_too(server):
    client = ReplayClient(server.address)
    client.reset("empty")
    before = _sampled(client, "empty")
    with client.stream("empty", 4) as stream:  # waits for data
        client.insert("empty", {"obs": torch.randn(10, 17)})
        for _ in range(3):
            next(stream)
        notes = "; ".join(stream.stats.notes)
        assert "batches_per_message=8" in notes and "grouped over gRPC" in notes, notes
        assert stream.transport == "grpc"  # the same-host ring was declined for them
        # The window became two groups of 8 (the first batch travelled alone): bounded.
        assert wait_for(lambda: _sampled(client, "empty") - before >= 16 * 4)
        assert stays(lambda: _sampled(client, "empty") - before <= (3 + 16 + 1) * 4)
