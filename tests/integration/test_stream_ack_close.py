"""``stream.ack()`` and ending a stream on a queue table (issue 34, item 5): real server, real clients.

An acknowledged batch never comes back, however the stream then ends; a batch
acknowledged too late (after leaving a ``for`` loop, which ends the stream and
gives back the batch held) is said so with ``StreamEndedError`` instead of being
handed out again in silence, as it was 9 times of 9.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from replay_client import ReplayClient, errors

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


def test_ack_after_leaving_the_loop_is_refused_not_lost(client):
    stream = client.stream("queue", BATCH, prefetch=4)
    for batch in stream:
        held = batch.data["x"].tolist()
        break  # leaving the loop ends the stream: the batch held goes back
    with pytest.raises(errors.StreamEndedError, match="ack\\(\\) after the stream ended"):
        stream.ack()
    stream.close()
    rest = _rest(client, ROWS)
    assert rest[:BATCH] == held  # handed out again, as the error said


def test_ack_after_close_without_a_batch_held_or_on_other_tables_is_a_no_op(client):
    stream = client.stream("queue", BATCH, prefetch=4)
    next(stream)
    stream.ack()
    stream.close()
    stream.ack()  # finished before it ended: nothing was given back, nothing to say
