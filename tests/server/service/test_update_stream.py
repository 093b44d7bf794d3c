"""UpdateStream on the wire, past the client library: answers in order, errors per request,
malformed or out-of-order messages end the stream with INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from replay_client import ReplayClient
from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import module_server

CONFIG = """
[[tables]]
name = "per"
capacity = 100
sampler = "prioritized"
"""

server = module_server(CONFIG)
METHOD = "/replay.v1.ReplayService/UpdateStream"


def _update(table: str, ids: list[int], priorities: list[float]) -> bytes:
    return messages.encode_update(table, np.array(ids, dtype=np.int64),
                                  np.array(priorities, dtype=np.float64))


def _exchange(address: str, requests: list[bytes]) -> list[pb.UpdateStreamResponse]:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(METHOD)(iter(requests), timeout=20)
        return [pb.UpdateStreamResponse.FromString(raw) for raw in call]


def test_each_request_is_answered_in_order_with_its_result_or_error(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": np.zeros(3, dtype=np.float32)}).tolist()
    answers = _exchange(server.address, [
        messages.encode_update_stream_request(0, _update("per", ids, [1.0, 2.0, 3.0])),
        messages.encode_update_stream_request(1, _update("per", [ids[0]], [-1.0])),
        messages.encode_update_stream_request(2, _update("nope", ids, [1.0, 1.0, 1.0])),
        messages.encode_update_stream_request(3, _update("per", ids[:2], [4.0, 4.0])),
    ])
    assert [a.sequence for a in answers] == [0, 1, 2, 3]
    assert answers[0].update_priorities.applied == 3 and not answers[0].HasField("error")
    assert (answers[1].error.code, answers[1].error.kind) == ("INVALID_ARGUMENT", "invalid_priority")
    assert (answers[2].error.code, answers[2].error.kind) == ("NOT_FOUND", "unknown_table")
    assert answers[3].update_priorities.applied == 2
    client.close()


@pytest.mark.parametrize("second", [b"\xff\xff\xff", "sequence"])
def test_a_malformed_or_out_of_order_message_ends_the_stream(server, second):
    first = messages.encode_update_stream_request(0, _update("per", [], []))
    bad = (messages.encode_update_stream_request(5, _update("per", [], []))
           if second == "sequence" else second)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(METHOD)(iter([first, bad]), timeout=20)
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for raw in call:
                answers.append(pb.UpdateStreamResponse.FromString(raw))
    assert len(answers) == 1 and answers[0].sequence == 0
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    kind = dict(info.value.trailing_metadata() or ()).get("replay-error-kind")
    assert kind == ("invalid_argument" if second == "sequence" else "malformed_request")


def test_a_message_larger_than_the_call_declared_ends_the_stream(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": np.zeros(3, dtype=np.float32)}).tolist()
    before = client.info()["per"].counters["priority_updates"]
    small = messages.encode_update_stream_request(0, _update("per", ids, [1.0, 2.0, 3.0]))
    large = messages.encode_update_stream_request(1, _update("per", [ids[0]] * 100, [5.0] * 100))
    declared = (("replay-request-bytes", str(len(small) + 8)),)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(METHOD)(iter([small, large]), metadata=declared, timeout=20)
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for raw in call:
                answers.append(pb.UpdateStreamResponse.FromString(raw))
    assert [a.update_priorities.applied for a in answers] == [3]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"larger than the call declared ({len(small) + 8} bytes" in info.value.details()
    # Nothing of the refused message was applied: the first update's priorities stand.
    assert client.info()["per"].counters["priority_updates"] == before + 3
    client.close()
