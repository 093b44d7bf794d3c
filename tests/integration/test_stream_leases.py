"""A learner's stream from a queue table delivers at least once, with leases: real servers, real clients.

Issue 23, "queue tables at least once, with leases", the streaming half: a
``SampleStream`` drew batches ahead of the learner (its prefetch window) and
took their rows for good, so the rows a learner had prefetched or was
working on were lost when it died (kill -9) or closed its stream. Now each
group is taken under a lease, the learner's credits say which batches it
finished, and when the stream ends the server gives back every batch not
finished (``docs/service.md``, "Delivery"). The books always balance:
appended = finished by a learner + still queued, no row twice.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from replay_client import ReplayClient
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, request_bytes_metadata
from replay_proto.sample_codec import decode_sample, split_sample
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, start_server, wait_for

BATCH = 10
CONFIG = """
[[tables]]
name = "queue"
capacity = 100000
sampler = "fifo"
"""

LEARNER = textwrap.dedent("""
    import sys, time, torch
    from replay_client import ReplayClient
    address, hold, shared_memory = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    client = ReplayClient(address, timeout=30)
    # Small batches are grouped over gRPC; one batch a message takes the ring when it can.
    stream = client.stream("queue", %d, prefetch=4, shared_memory=shared_memory,
                           batches_per_message=1 if shared_memory else None)
    for taken, batch in enumerate(stream, 1):
        print(" ".join(map(str, batch.data["x"].tolist())), flush=True)
        if taken == hold:
            print("holding", stream.transport, flush=True)
            time.sleep(600)  # killed here, holding this batch, the next ones prefetched
""" % BATCH)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("leases"), CONFIG)
    yield proc
    proc.stop()


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """The module's server, its queue emptied first: a reset removes the rows and forgets
    every lease, so no earlier test's rows or leases come back. Its counters keep counting
    across tests: read them with :func:`counter`, as what the test itself caused."""
    with ReplayClient(shared_server.address, timeout=30) as client:
        client.reset("queue")
        assert client.info()["queue"].size == 0
    return shared_server


def counter(client: ReplayClient, name: str) -> int:
    """The queue's counter ``name`` (``sampled``, ``returned``, ``inserted``)."""
    return client.info()["queue"].counters[name]


def fill(client: ReplayClient, first: int, n: int) -> None:
    """Rows ``first .. first + n - 1`` (column ``x``)."""
    client.insert("queue", {"x": torch.arange(first, first + n)})


def learner_killed_holding(server: ServerProcess, hold: int,
                           shared_memory: bool) -> tuple[list[list[int]], str]:
    """A learner process that took ``hold`` batches (finished ``hold - 1``: a batch is
    finished when the next is taken) and had the server draw ahead, killed with SIGKILL;
    the batches it received, and its transport."""
    with ReplayClient(server.address, timeout=30) as probe:
        sampled = counter(probe, "sampled")
    child = subprocess.Popen(
        [sys.executable, "-c", LEARNER, server.address, str(hold), str(int(shared_memory))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    batches: list[list[int]] = []
    transport = ""
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("holding"):
                transport = line.split()[1]
                break
            batches.append([int(x) for x in line.split()])
        assert len(batches) == hold, child.stderr.read() if child.stderr else ""
        with ReplayClient(server.address, timeout=30) as probe:
            # The positive event: the server drew past the batch held (the prefetch window).
            assert wait_for(lambda: counter(probe, "sampled") - sampled > hold * BATCH)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    return batches, transport


def drain_stream(client: ReplayClient, rows: int, **options) -> list[int]:
    """Every row a second learner's stream hands out, ``rows`` of them, batch by batch."""
    got: list[int] = []
    with client.stream("queue", BATCH, num_batches=rows // BATCH, **options) as stream:
        for batch in stream:
            got += batch.data["x"].tolist()
    return got


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shared_memory"])
def test_a_learner_killed_mid_stream_loses_no_row(server, shared_memory) -> None:
    rows, hold = 400, 5
    with ReplayClient(server.address, timeout=30) as client:
        returned = counter(client, "returned")
        fill(client, 0, rows)
        batches, transport = learner_killed_holding(server, hold, shared_memory)
        assert transport == ("shared_memory" if shared_memory else "grpc")
        finished = [x for batch in batches[:-1] for x in batch]
        # What the dead learner did not finish (the batch it held, those prefetched) is back.
        left = rows - len(finished)
        assert wait_for(lambda: client.info()["queue"].size == left), client.info()["queue"]
        assert counter(client, "returned") - returned >= BATCH * 2  # held + prefetched
        again = drain_stream(client, left, shared_memory=shared_memory)
    assert sorted(finished + again) == list(range(rows)), "a row was lost or handed out twice"
    assert again[:BATCH] == batches[-1]  # the batch held comes back first (fifo)


def test_a_clean_close_gives_back_the_batches_not_finished(server) -> None:
    with ReplayClient(server.address, timeout=30) as client:
        sampled = counter(client, "sampled")
        fill(client, 0, 200)
        stream = client.stream("queue", BATCH, prefetch=4)
        taken = [next(stream).data["x"].tolist() for _ in range(3)]
        assert wait_for(lambda: counter(client, "sampled") - sampled > 3 * BATCH)
        stream.close()  # the third batch was taken, not finished: it comes back too
        assert wait_for(lambda: client.info()["queue"].size == 200 - 2 * BATCH)
        rest = drain_stream(client, 200 - 2 * BATCH)
    assert rest[:BATCH] == taken[2]
    assert sorted(taken[0] + taken[1] + rest) == list(range(200))


def test_ack_finishes_the_batch_held_before_close(server) -> None:
    with ReplayClient(server.address, timeout=30) as client:
        fill(client, 0, 100)
        with client.stream("queue", BATCH, prefetch=2) as stream:
            taken = [next(stream).data["x"].tolist() for _ in range(2)]
            stream.ack()
        assert wait_for(lambda: client.info()["queue"].size == 100 - 2 * BATCH)
        rest = drain_stream(client, 100 - 2 * BATCH)
    assert sorted(taken[0] + taken[1] + rest) == list(range(100))
    assert not set(rest) & set(taken[0] + taken[1])


def test_live_learners_receive_each_row_exactly_once(server) -> None:
    """Learners come and go (closing mid-stream, each finishing some batches), an actor keeps
    appending: every row reaches exactly one learner that finished it, none twice."""
    rows = 1200
    finished: list[int] = []
    with ReplayClient(server.address, timeout=30) as client:
        inserted = counter(client, "inserted")
        for start in range(0, rows, 200):
            fill(client, start, 200)
            with client.stream("queue", BATCH, prefetch=3) as stream:
                got = [next(stream).data["x"].tolist() for _ in range(7)]
            finished += [x for batch in got[:-1] for x in batch]  # the last one was not finished
        left = rows - len(finished)
        assert wait_for(lambda: client.info()["queue"].size == left)
        finished += drain_stream(client, left)
        inserted = counter(client, "inserted") - inserted
    assert len(finished) == rows and sorted(finished) == list(range(rows))
    assert inserted == rows


def test_a_stream_of_num_batches_ends_with_everything_finished(server) -> None:
    with ReplayClient(server.address, timeout=30) as client:
        returned = counter(client, "returned")
        fill(client, 0, 100)
        got = drain_stream(client, 100)
        assert got == list(range(100))
        info = client.info()["queue"]
        assert info.size == 0 and info.counters["returned"] - returned == 0


def _raw_stream(server: ServerProcess, *messages: pb.SampleStreamRequest) -> Iterator[bytes]:
    channel = grpc.insecure_channel(server.address)
    call = channel.stream_stream("/replay.v1.ReplayService/SampleStream")(
        (m.SerializeToString() for m in messages), timeout=30,
        metadata=request_bytes_metadata(STREAM_MESSAGE_BYTES))
    try:
        yield from call
    finally:
        channel.close()


def test_finishing_more_batches_than_sent_is_refused_and_loses_nothing(server) -> None:
    with ReplayClient(server.address, timeout=30) as client:
        fill(client, 0, 50)
        opening = pb.SampleStreamRequest(
            request=pb.SampleRequest(table="queue", batch_size=BATCH), credits=1,
            lease="raw-learner")
        with pytest.raises(grpc.RpcError) as caught:
            for raw in _raw_stream(server, opening, pb.SampleStreamRequest(finished=5)):
                assert split_sample(raw)[0].leased
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "finished" in caught.value.details()
        assert wait_for(lambda: client.info()["queue"].size == 50)  # its batch came back


def test_a_lease_prefix_too_long_is_refused_naming_the_limit(server) -> None:
    with ReplayClient(server.address, timeout=30) as client:
        fill(client, 0, 50)
        opening = pb.SampleStreamRequest(
            request=pb.SampleRequest(table="queue", batch_size=BATCH), credits=1,
            lease="x" * 1000)
        with pytest.raises(grpc.RpcError) as caught:
            list(_raw_stream(server, opening))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease prefix" in caught.value.details()
        assert client.info()["queue"].size == 50


def test_a_stream_without_a_lease_takes_rows_for_good(server) -> None:
    """Old learners (no lease in the first message) keep the old behaviour."""
    with ReplayClient(server.address, timeout=30) as client:
        returned = counter(client, "returned")
        fill(client, 0, 50)
        opening = pb.SampleStreamRequest(
            request=pb.SampleRequest(table="queue", batch_size=BATCH, num_batches=2), credits=2)
        headers = [split_sample(raw)[0] for raw in _raw_stream(server, opening)]
        assert not any(h.leased for h in headers)
        assert client.info()["queue"].size == 30
        assert counter(client, "returned") - returned == 0


def test_a_clean_server_stop_saves_the_batches_not_finished_in_the_queue(tmp_path) -> None:
    """SIGTERM while a learner streams: the final checkpoint holds every row but those of the
    batches the learner finished; the restarted server hands them out (docs/durability.md)."""
    config = f'[server]\ncheckpoint_dir = "{tmp_path / "checkpoints"}"\n' + CONFIG
    server = start_server(tmp_path, config)
    with ReplayClient(server.address, timeout=30) as client:
        fill(client, 0, 100)
        stream = client.stream("queue", BATCH, prefetch=2, reconnect=False)
        taken = [next(stream).data["x"].tolist() for _ in range(3)]
        # The positive event: the draw the third credit allowed (it applied the first two
        # batches' acknowledgements first).
        assert wait_for(lambda: client.info()["queue"].counters["sampled"] >= 5 * BATCH)
        assert server.stop(signal.SIGTERM) == 0
        stream.close()
    server = start_server(tmp_path, config, name="restarted")
    try:
        with ReplayClient(server.address, timeout=30) as client:
            assert client.info()["queue"].size == 100 - 2 * BATCH
            again = drain_stream(client, 100 - 2 * BATCH)
    finally:
        server.stop()
    assert sorted(taken[0] + taken[1] + again) == list(range(100))


@pytest.mark.slow
def test_soak_learners_killed_again_and_again_lose_no_row(server) -> None:
    """Eight learners killed with SIGKILL in turn, each after a few batches, over 4,000 rows;
    then one drains the rest: every row finished exactly once."""
    rows, finished = 4000, []
    with ReplayClient(server.address, timeout=30) as client:
        fill(client, 0, rows)
        for hold in (3, 7, 2, 9, 5, 4, 8, 6):
            batches, _ = learner_killed_holding(server, hold, shared_memory=hold % 2 == 0)
            finished += [x for batch in batches[:-1] for x in batch]
            left = rows - len(finished)
            assert wait_for(lambda: client.info()["queue"].size == left)
        finished += drain_stream(client, rows - len(finished))
    assert sorted(finished) == list(range(rows))


def _held_stream(server: ServerProcess, opening: pb.SampleStreamRequest,
                 release: threading.Event) -> tuple[Any, list[int]]:
    """A raw stream that stays open (its request side waits on ``release``) and the rows of
    its first batch; the call is returned to be cancelled (the learner dies)."""
    def requests() -> Iterator[bytes]:
        yield opening.SerializeToString()
        release.wait(30)

    channel = grpc.insecure_channel(server.address)
    call = channel.stream_stream("/replay.v1.ReplayService/SampleStream")(
        requests(), timeout=30, metadata=request_bytes_metadata(STREAM_MESSAGE_BYTES))
    raw = next(call)
    assert split_sample(raw)[0].leased
    return (call, channel), decode_sample(raw).columns["x"].tolist()


def test_a_streams_leases_are_its_own_whatever_prefix_it_names(server) -> None:
    """Issue 34, item 12: two live streams naming one prefix got the same rows, and another
    client's Acknowledge of '<prefix>/0' took a live stream's rows for good (lost when the
    stream's learner then died). A stream's lease names now carry a secret of the call."""
    release = threading.Event()
    with ReplayClient(server.address, timeout=30) as client:
        fill(client, 0, 50)
        opening = pb.SampleStreamRequest(
            request=pb.SampleRequest(table="queue", batch_size=BATCH), credits=1,
            lease="shared")
        (first, first_channel), first_rows = _held_stream(server, opening, release)
        (second, second_channel), second_rows = _held_stream(server, opening, release)
        assert first_rows == list(range(BATCH))
        assert second_rows == list(range(BATCH, 2 * BATCH))  # not the first stream's again
        channel = grpc.insecure_channel(server.address)
        try:
            channel.unary_unary("/replay.v1.ReplayService/Acknowledge")(
                pb.AcknowledgeRequest(table="queue", leases=["shared/0"]).SerializeToString(),
                timeout=10)
            raw = channel.unary_unary("/replay.v1.ReplayService/Sample")(
                pb.SampleRequest(table="queue", batch_size=BATCH,
                                 lease="shared/0").SerializeToString(), timeout=10)
        finally:
            channel.close()
        taken = decode_sample(raw).columns["x"].tolist()
        assert not set(taken) & set(first_rows + second_rows)  # never a live stream's rows
        first.cancel()  # its learner dies: its batch goes back, none was acknowledged by name
        first_channel.close()
        # taken: each stream's batch and the Sample's; back: the first stream's
        assert wait_for(lambda: client.info()["queue"].size == 50 - 3 * BATCH + BATCH)
        release.set()
        second.cancel()
        second_channel.close()
        assert wait_for(lambda: client.info()["queue"].size == 50 - BATCH)  # the Sample's


def test_a_first_message_that_leaves_draws_nothing(server) -> None:
    """Issue 34, item 14: ``closing`` in a stream's first message was ignored (the stream
    drew the batches its credits allowed). Leaving at once draws nothing and ends with OK."""
    with ReplayClient(server.address, timeout=30) as client:
        returned = counter(client, "returned")
        fill(client, 0, 50)
        opening = pb.SampleStreamRequest(
            request=pb.SampleRequest(table="queue", batch_size=BATCH), credits=3,
            lease="leaving", closing=True)
        assert list(_raw_stream(server, opening)) == []
        info = client.info()["queue"]
        assert info.size == 50 and info.counters["returned"] - returned == 0
