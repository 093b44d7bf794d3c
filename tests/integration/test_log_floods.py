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

import grpc
import pytest
import torch

from replay_client import ReplayClient
from replay_feed.shared_ring import host_id
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, module_server, wait_for

CONFIG = """
[[tables]]
name = "rows"
capacity = 1000

[[tables]]
name = "gate"
capacity = 1000
min_size_to_sample = 100
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
