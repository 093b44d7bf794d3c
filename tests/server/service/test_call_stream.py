"""CallStream (and UpdateStream, its older name) on the wire, past the client library: answers
in order, errors per request, inserts beside updates, a rate-limited insert answered at its
own timeout, malformed or out-of-order messages end the stream with INVALID_ARGUMENT, and call
streams hold at most half of max_streams."""

from __future__ import annotations

import queue
import time

import grpc
import numpy as np
import pytest
import torch

from replay_client import ReplayClient
from replay_proto import messages
from replay_proto.codec import frame
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import module_server, wait_for

CONFIG = """
[[tables]]
name = "per"
capacity = 100
sampler = "prioritized"

[[tables]]
name = "held"
capacity = 100
min_size_to_sample = 2
samples_per_insert = 1.0
error_buffer = 1.0
"""

server = module_server(CONFIG)
METHOD = "/replay.v1.ReplayService/CallStream"


def _update(table: str, ids: list[int], priorities: list[float]) -> bytes:
    return messages.encode_update(table, np.array(ids, dtype=np.int64),
                                  np.array(priorities, dtype=np.float64))


def _call(sequence: int, update: bytes) -> bytes:
    return messages.encode_call_request(sequence, "update_priorities", update)


def _insert(sequence: int, table: str, rows: int, timeout_s: float | None = None) -> bytes:
    header, buffers = messages.insert_parts(table, {"x": torch.arange(rows, dtype=torch.float32)})
    return messages.encode_call_request(sequence, "insert", frame(header, buffers), timeout_s)


def _exchange(address: str, requests: list[bytes], method: str = METHOD
              ) -> list[pb.CallStreamResponse]:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(method)(iter(requests), timeout=20)
        return [pb.CallStreamResponse.FromString(raw) for raw in call]


@pytest.mark.parametrize("method", [METHOD, "/replay.v1.ReplayService/UpdateStream"])
def test_each_request_is_answered_in_order_with_its_result_or_error(server, method):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": np.zeros(3, dtype=np.float32)}).tolist()
    answers = _exchange(server.address, [
        _call(0, _update("per", ids, [1.0, 2.0, 3.0])),
        _call(1, _update("per", [ids[0]], [-1.0])),
        _call(2, _update("nope", ids, [1.0, 1.0, 1.0])),
        _call(3, _update("per", ids[:2], [4.0, 4.0])),
    ], method)
    assert [a.sequence for a in answers] == [0, 1, 2, 3]
    assert answers[0].update_priorities.applied == 3 and not answers[0].HasField("error")
    assert (answers[1].error.code, answers[1].error.kind) == ("INVALID_ARGUMENT", "invalid_priority")
    assert (answers[2].error.code, answers[2].error.kind) == ("NOT_FOUND", "unknown_table")
    assert answers[3].update_priorities.applied == 2
    client.close()


@pytest.mark.parametrize("second", [b"\xff\xff\xff", "sequence"])
def test_a_malformed_or_out_of_order_message_ends_the_stream(server, second):
    first = _call(0, _update("per", [], []))
    bad = _call(5, _update("per", [], [])) if second == "sequence" else second
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(METHOD)(iter([first, bad]), timeout=20)
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for raw in call:
                answers.append(pb.CallStreamResponse.FromString(raw))
    assert len(answers) == 1 and answers[0].sequence == 0
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    kind = dict(info.value.trailing_metadata() or ()).get("replay-error-kind")
    assert kind == ("invalid_argument" if second == "sequence" else "malformed_request")


def test_a_message_larger_than_the_call_declared_ends_the_stream(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": np.zeros(3, dtype=np.float32)}).tolist()
    before = client.info()["per"].counters["priority_updates"]
    small = _call(0, _update("per", ids, [1.0, 2.0, 3.0]))
    large = _call(1, _update("per", [ids[0]] * 100, [5.0] * 100))
    declared = (("replay-request-bytes", str(len(small) + 8)),)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(METHOD)(iter([small, large]), metadata=declared, timeout=20)
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for raw in call:
                answers.append(pb.CallStreamResponse.FromString(raw))
    assert [a.update_priorities.applied for a in answers] == [3]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"larger than the call declared ({len(small) + 8} bytes" in info.value.details()
    # Nothing of the refused message was applied: the first update's priorities stand.
    assert client.info()["per"].counters["priority_updates"] == before + 3
    client.close()


def test_inserts_beside_updates_each_answered_in_turn_and_a_refused_one_stores_nothing(server):
    client = ReplayClient(server.address)
    client.reset("per")
    first = client.insert("per", {"x": torch.zeros(1)}).tolist()
    size = client.info()["per"].size
    answers = _exchange(server.address, [
        _insert(0, "per", 3),
        _insert(1, "nope", 2),
        _call(2, _update("per", first, [1.0])),
        _insert(3, "per", 2),
    ])
    assert [a.WhichOneof("result") for a in answers] == ["insert", "error", "update_priorities",
                                                         "insert"]
    assert answers[0].insert.count == 3 and answers[3].insert.count == 2
    assert answers[3].insert.first_id == answers[0].insert.first_id + 3  # nothing issued between
    assert (answers[1].error.code, answers[1].error.kind) == ("NOT_FOUND", "unknown_table")
    assert client.info()["per"].size == size + 5
    start = answers[0].insert.first_id
    read = client.read("per", ids=torch.arange(start, start + 3))
    assert read.columns["x"].tolist() == [0.0, 1.0, 2.0]
    client.close()


def test_an_insert_its_rate_limiter_holds_is_answered_at_its_own_timeout(server):
    """The stream goes on after it, and the refused insert was never stored."""
    client = ReplayClient(server.address)
    client.reset("held")
    client.insert("held", {"x": torch.zeros(3)})  # filling up is free; now at the top
    started = time.monotonic()
    answers = _exchange(server.address, [_insert(0, "held", 1, timeout_s=0.5),
                                         _insert(1, "nope", 1)])
    waited = time.monotonic() - started
    assert answers[0].error.code == "DEADLINE_EXCEEDED", answers[0]
    assert "blocked by" in answers[0].error.message and "until the deadline" in answers[0].error.message
    assert answers[1].error.kind == "unknown_table"  # the stream went on
    assert 0.3 < waited < 10
    assert client.info()["held"].size == 3
    client.close()


def test_call_streams_hold_at_most_half_of_max_streams_and_sample_streams_the_rest(
        server_factory):
    server_ = server_factory(CONFIG.replace('[[tables]]\nname = "per"',
                                            '[server]\nmax_streams = 4\nmax_host_share = 1.0\n\n[[tables]]\nname = "per"',
                                            1))
    client = ReplayClient(server_.address)
    client.insert("per", {"x": torch.zeros(4)}, priorities=torch.ones(4))  # on a call stream
    client.close()  # which ends here, once the server has read the cancel
    assert wait_for(lambda: client.server_info().limits["streams_open"] == 0, timeout=10)
    with grpc.insecure_channel(server_.address) as channel:
        method = channel.stream_stream(METHOD)
        held = [queue.SimpleQueue() for _ in range(3)]
        calls = [method(iter(q.get, None), timeout=20) for q in held]
        for k, (q, call) in enumerate(zip(held, calls, strict=True)):
            q.put(_insert(0, "per", 1))
            if k < 2:
                answer = pb.CallStreamResponse.FromString(next(call))
                assert answer.insert.count == 1
        with pytest.raises(grpc.RpcError) as info:
            next(calls[2])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 call streams (half of server.max_streams)" in info.value.details()
        # a learner's stream still opens beside the two call streams
        with client.stream("per", batch_size=2) as stream:
            assert len(next(iter(stream)).ids) == 2
        for q in held:
            q.put(None)
    assert client.info()["per"].size == 6  # the refused stream's insert was never stored
    client.close()
