"""One client repeating a mistake cannot flood the server's log; expected ends log no errors.

Issue 10, finding 11: repeated client mistakes wrote one log line each
(tens of thousands a second), and cancelled streams logged ERROR tracebacks.
Lines about a client are now rate-limited per client host (at most 5 per
minute, then one line saying how many were held back: see
``replay_server.service.peer_log``); calls that end because the client
cancelled them are logged at DEBUG. A real server, raw gRPC calls on
loopback, every loop bounded.
"""

from __future__ import annotations

import queue
import re
import threading
import time

import grpc
import pytest
import torch
from replay_client import ReplayClient, errors
from replay_feed.shared_ring import host_id
from replay_proto.v1 import replay_pb2 as pb
from replay_server.service.peer_log import TOTAL, WINDOW_S

from tests.conftest import ServerProcess, module_server, wait_for
from tests.integration.raw_http2 import RawConnection

CONFIG = """
[server]
max_streams = 256  # the 200 blocked streams below (the default is 128)
max_host_share = 1.0  # ... all from 127.0.0.1

[[tables]]
name = "rows"
capacity = 1000

[[tables]]
name = "gate"
capacity = 1000
min_size_to_sample = 100

[[tables]]
name = "wide"
capacity = 10
"""

BURST = 5

server = module_server(CONFIG)


@pytest.fixture(scope="module")
def channel(server: ServerProcess):
    ReplayClient(server.address).insert("rows", {"x": torch.zeros(100, 4)})
    with grpc.insecure_channel(server.address) as channel:
        yield channel


def lines(server: ServerProcess, pattern: str) -> list[str]:
    return [line for line in server.log().splitlines() if re.search(pattern, line)]


def test_a_learner_refusing_every_ring_is_logged_a_few_times_not_each_time(server, channel):
    stream = channel.stream_stream("/replay.v1.ReplayService/SampleStream")
    first = pb.SampleStreamRequest(request=pb.SampleRequest(table="rows", batch_size=4),
                                   credits=1, shared_memory=True, host_id=host_id())
    refusal = pb.SampleStreamRequest(credits=1, shared_memory_answer=pb.SharedMemoryAnswer(
        accepted=False, reason="this learner refuses every ring"))
    for _ in range(100):
        answers: queue.SimpleQueue = queue.SimpleQueue()

        def requests(answers=answers):
            yield first.SerializeToString()
            yield answers.get(timeout=30)

        call = stream(requests(), timeout=30)
        response = pb.SampleResponse.FromString(next(call))
        assert response.HasField("shared_memory_offer")
        answers.put(refusal.SerializeToString())
        second = pb.SampleResponse.FromString(next(call))  # read after the refusal: over gRPC
        assert not second.HasField("shared_memory")
        call.cancel()
    assert wait_for(lambda: len(lines(server, "refused the shared-memory ring")) >= BURST)
    assert len(lines(server, "refused the shared-memory ring")) == BURST


def test_a_flood_of_bad_calls_is_logged_a_few_times(server, channel):
    sample = channel.unary_unary("/replay.v1.ReplayService/Sample")
    for _ in range(500):
        with pytest.raises(grpc.RpcError) as info:
            sample(pb.SampleRequest(table="no_such_table", batch_size=4).SerializeToString(),
                   timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    refused = lines(server, "refused a call from .*NOT_FOUND")
    assert 1 <= len(refused) <= BURST
    assert "no table named 'no_such_table'" in refused[0]


def test_cancelling_two_hundred_blocked_streams_logs_no_error(server, channel):
    stream = channel.stream_stream("/replay.v1.ReplayService/SampleStream")
    first = pb.SampleStreamRequest(request=pb.SampleRequest(table="gate", batch_size=4),
                                   credits=2).SerializeToString()
    release = threading.Event()

    def requests():
        yield first
        release.wait(60)

    calls = [stream(requests(), timeout=60) for _ in range(200)]
    client = ReplayClient(server.address)
    assert wait_for(lambda: client.info()["gate"].rate_limiter["blocked_samples"] == 200)
    for call in calls:
        call.cancel()
    release.set()
    assert wait_for(lambda: client.info()["gate"].rate_limiter["blocked_samples"] == 0)
    log = server.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------- issue 23, finding 10

GLOBAL_LINES = TOTAL  # lines about all clients together per window


@pytest.mark.parametrize("addresses", [300, pytest.param(2000, marks=pytest.mark.slow)])
def test_a_client_rotating_its_address_gets_the_global_limit(server_factory, addresses) -> None:
    """2,000 source addresses once wrote 9,976 lines in 18 s (5 per address per minute).

    The limit is per window (60 s, the first starting with the server): the test has a server
    of its own so that its loop is not cut by a window that began with an earlier test (a
    clean-clone CI logged 81 + 100 lines across such a boundary). A loop that outlasts a
    window (a loaded machine) is allowed one more window's lines per window begun.
    """
    started = time.monotonic()
    rotated = server_factory("[[tables]]\nname = \"rows\"\ncapacity = 10\n")
    request = pb.SampleRequest(table="rotating_no_such_table", batch_size=1).SerializeToString()
    for i in range(addresses):  # one line each before, 5 per address a minute
        connection = RawConnection(rotated.port, source=f"127.1.{i // 200}.{i % 200 + 1}")
        try:
            if connection.handshake():
                connection.call("/replay.v1.ReplayService/Sample", request)
                connection.answered()
        finally:
            connection.close()
    windows = 1 + int((time.monotonic() - started) // WINDOW_S)
    logged = len(lines(rotated, "refused a call from"))
    assert logged <= GLOBAL_LINES * windows, (logged, windows)  # for every client together
    assert lines(rotated, "more about any client in the next 60 s are counted")


def test_huge_values_make_short_lines_and_short_typed_errors(server, channel) -> None:
    """An 8 MiB table name made an 8 MiB log line; an error listing a large schema became a
    status no client could receive (MessageTooLargeError instead of the typed error). The
    name here is 3 MiB: a message stays under max_message_mb (4 MiB)."""
    name = "n" * (3 << 20)
    sample = channel.unary_unary("/replay.v1.ReplayService/Sample")
    with pytest.raises(grpc.RpcError) as info:
        sample(pb.SampleRequest(table=name, batch_size=4).SerializeToString(), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(info.value.details()) <= 2048 and "characters in all" in info.value.details()
    client = ReplayClient(server.address)
    wide = {f"column_{i:05d}_with_a_long_descriptive_name": torch.zeros(1, 1)
            for i in range(5000)}
    client.insert("wide", wide)
    with pytest.raises(errors.SchemaMismatchError) as mismatch:
        client.insert("wide", {**wide, "extra": torch.zeros(1, 1)})
    assert "characters in all" in str(mismatch.value)
    assert max(len(line) for line in server.log().splitlines()) < 20_000
