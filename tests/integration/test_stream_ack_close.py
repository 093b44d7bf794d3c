"""``stream.ack()`` and ending a stream on a queue table (issue 34, item 5): real server, real clients.

An acknowledged batch never comes back, however the stream then ends. A
learner that leaves a ``for`` loop (``break``) and then acknowledges, as
``ack()`` then ``close()`` reads, keeps the batch: the stream left holding it
waits ``LATE_ACK_S`` for that ack (before, leaving the loop ended the stream
and gave the batch back, and the ack that followed was lost: the batch was
handed out again 9 times of 9). An ack that comes after the stream really
ended (closed, or left and not acknowledged in time) cannot be kept: it raises
``StreamEndedError`` instead of being lost in silence.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from replay_client import ReplayClient, errors

from replay_feed.stream import LATE_ACK_S
from tests.conftest import ServerProcess, start_server, wait_for

BATCH = 10
ROWS = 100
CONFIG = """
[[tables]]
name = "queue"
capacity = 1000
sampler = "fifo"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("server"), CONFIG)
    yield proc
    proc.stop()


@pytest.fixture
def client(server) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=30) as client:
        client.reset("queue")
        client.insert("queue", {"x": torch.arange(ROWS)})
        yield client


def _rest(client: ReplayClient, left: int) -> list[int]:
    """What a new learner gets once ``left`` rows are back in the queue: all of them."""
    assert wait_for(lambda: client.info()["queue"].size == left), client.info()["queue"]
    with ReplayClient(client.address, timeout=30) as learner:
        with learner.stream("queue", BATCH, num_batches=left // BATCH) as stream:
            return [x for batch in stream for x in batch.data["x"].tolist()]


@pytest.mark.parametrize("taken", [1, 3])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shared_memory"])
def test_ack_then_close_never_hands_the_batches_out_again(client, taken, shared_memory):
    stream = client.stream("queue", BATCH, prefetch=4, shared_memory=shared_memory,
                           batches_per_message=1)
    got = [x for _ in range(taken) for x in next(stream).data["x"].tolist()]
    stream.ack()
    stream.close()
    rest = _rest(client, ROWS - taken * BATCH)
    assert not set(rest) & set(got), "an acknowledged row was handed out again"
    assert sorted(got + rest) == list(range(ROWS))


def test_ack_inside_the_loop_before_break_keeps_the_batch(client):
    got: list[int] = []
    with client.stream("queue", BATCH, prefetch=4) as stream:
        for batch in stream:
            got += batch.data["x"].tolist()
            if len(got) == 2 * BATCH:
                stream.ack()
                break
    rest = _rest(client, ROWS - 2 * BATCH)
    assert not set(rest) & set(got), "an acknowledged row was handed out again"
    assert sorted(got + rest) == list(range(ROWS))


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shared_memory"])
def test_ack_after_leaving_the_loop_keeps_the_batch(client, shared_memory):
    stream = client.stream("queue", BATCH, prefetch=4, shared_memory=shared_memory,
                           batches_per_message=1)
    got: list[int] = []
    for batch in stream:
        got += batch.data["x"].tolist()
        if len(got) == 2 * BATCH:
            break  # the learner leaves the loop, then acknowledges: ack() then close()
    assert list(stream) == []  # a left stream hands out nothing more
    stream.ack()
    stream.close()
    rest = _rest(client, ROWS - 2 * BATCH)
    assert not set(rest) & set(got), "an acknowledged row was handed out again"
    assert sorted(got + rest) == list(range(ROWS))


def test_a_left_stream_not_acknowledged_in_time_gives_its_batch_back_and_says_so(client):
    stream = client.stream("queue", BATCH, prefetch=4)
    for batch in stream:
        held = batch.data["x"].tolist()
        break
    # The batch held and those prefetched come back once LATE_ACK_S has passed.
    assert wait_for(lambda: client.info()["queue"].size == ROWS, timeout=LATE_ACK_S + 30)
    with pytest.raises(errors.StreamEndedError, match="ack\\(\\) after the stream ended"):
        stream.ack()
    stream.close()
    rest = _rest(client, ROWS)
    assert rest[:BATCH] == held  # handed out again, as the error said


def test_ack_after_close_holding_a_batch_is_refused_not_lost(client):
    stream = client.stream("queue", BATCH, prefetch=4)
    held = next(stream).data["x"].tolist()
    stream.close()
    with pytest.raises(errors.StreamEndedError, match="before close\\(\\)"):
        stream.ack()
    assert _rest(client, ROWS)[:BATCH] == held


def test_ack_after_close_without_a_batch_held_or_on_other_tables_is_a_no_op(client):
    stream = client.stream("queue", BATCH, prefetch=4)
    next(stream)
    stream.ack()
    stream.close()
    stream.ack()  # finished before it ended: nothing was given back, nothing to say
