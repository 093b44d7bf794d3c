"""update_priorities(wait=True) and small inserts on the client's persistent CallStreams,
against a real server.

Answers come back per request and in order, refused requests raise their own
typed error while the stream goes on, concurrent senders share one bounded
stream, and a server that lacks the RPC (a stand-in for an older version)
gets UpdateStream or unary calls instead. What happens to an insert when its
stream breaks is in ``test_call_stream_inserts.py``.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_client.call_stream import CallStream
from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb
from tests.client.test_updates import _probabilities
from tests.conftest import grpc_calls_only, module_server, wait_for

# Waiting updates from the server's host go over its local socket: these tests are of the
# call stream, which updates from another host take.
_grpc = grpc_calls_only()

CONFIG = """
[[tables]]
name = "per"
capacity = 1000
sampler = "prioritized"
alpha = 1.0

[[tables]]
name = "flat"
capacity = 1000
sampler = "uniform"
"""

server = module_server(CONFIG)


def test_waiting_updates_go_on_one_stream_and_apply_in_order(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(3)}, priorities=torch.ones(3))
    for value in (4.0, 9.0, 2.0):
        assert client.update_priorities("per", ids[:2], torch.tensor([value, 1.0])) == 2
    stream = client._call_streams["update_priorities"]
    assert stream is not None and stream.supported
    session = stream._session
    assert session is not None and session.sequence == 3  # all three on one call
    probabilities = _probabilities(client, "per")
    assert probabilities[int(ids[0])] == pytest.approx(2.0 / 4.0)
    client.close()


def test_a_refused_request_raises_its_type_and_the_stream_goes_on(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(2)}, priorities=torch.ones(2))
    assert client.update_priorities("per", ids, torch.tensor([1.0, 2.0])) == 2
    session = client._call_streams["update_priorities"]._session
    before = client.info()["per"].counters["priority_updates"]
    with pytest.raises(errors.InvalidIdsError, match="never issued"):
        client.update_priorities("per", ids[-1:] + 1000, torch.tensor([1.0]))  # not yet issued
    with pytest.raises(errors.UnknownTableError, match="nope"):
        client.update_priorities("nope", ids, torch.tensor([1.0, 2.0]))
    with pytest.raises(errors.NoPrioritiesError):
        client.update_priorities("flat", ids, torch.tensor([1.0, 2.0]))
    assert client.update_priorities("per", ids, torch.tensor([3.0, 1.0])) == 2
    assert client._call_streams["update_priorities"]._session is session  # the same call answered every request
    # the refused requests changed nothing
    assert client.info()["per"].counters["priority_updates"] == before + 2
    client.close()


def test_stale_ids_are_counted_not_applied(server):
    client = ReplayClient(server.address)
    client.reset("per")
    old = client.insert("per", {"x": torch.zeros(1)}, priorities=torch.ones(1))
    client.reset("per")
    client.insert("per", {"x": torch.zeros(1)}, priorities=torch.ones(1))
    assert client.update_priorities("per", old, torch.tensor([5.0])) == 0
    client.close()


def test_concurrent_senders_share_a_bounded_stream(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(8)}, priorities=torch.ones(8))
    client._call_streams = {"update_priorities": CallStream(client._connection, "update_priorities",
                                                            window=2)}
    client._call_streams_pid = __import__("os").getpid()

    def work(k: int) -> int:
        total = 0
        for step in range(20):
            total += client.update_priorities("per", ids[k:k + 1], torch.tensor([k + 1.0 + step % 2]))
        return total

    with futures.ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(work, range(8))) == 160
    # the last value of thread k was k + 2 (step 19 is odd)
    probabilities = _probabilities(client, "per")
    mass = sum(k + 2.0 for k in range(8))
    for k in range(8):
        assert probabilities[int(ids[k])] == pytest.approx((k + 2.0) / mass)
    client.close()


def test_async_updates_flow_through_the_stream_too(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(2)}, priorities=torch.ones(2))
    for value in (5.0, 7.0):
        client.update_priorities("per", ids[:1], torch.tensor([value]), wait=False)
    client.flush_updates()
    assert _probabilities(client, "per")[int(ids[0])] == pytest.approx(7.0 / 8.0)
    client.close()


def _stand_in(handlers: dict) -> tuple[grpc.Server, int]:
    """A gRPC server with only ``handlers`` (a stand-in for another server version)."""
    stand_in = grpc.server(futures.ThreadPoolExecutor(2))
    stand_in.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("replay.v1.ReplayService", handlers),))
    port = stand_in.add_insecure_port("127.0.0.1:0")
    stand_in.start()
    return stand_in, port


def test_a_server_without_the_stream_gets_unary_calls():
    calls = []

    def update(raw: bytes, context) -> bytes:  # as a server from before UpdateStream
        _, ids, _ = messages.decode_update(raw)
        calls.append(len(ids))
        return pb.UpdatePrioritiesResponse(applied=len(ids)).SerializeToString()

    old, port = _stand_in({"UpdatePriorities": grpc.unary_unary_rpc_method_handler(update)})
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=10)
        ids = np.arange(5, dtype=np.int64)
        stream = client._stream("update_priorities")
        assert client.update_priorities("per", ids, np.ones(5)) == 5  # CallStream: unknown
        assert stream._methods == ["UpdateStream"] and stream.supported
        assert client.update_priorities("per", ids, np.ones(5)) == 5  # UpdateStream: unknown
        assert stream.supported is False
        assert client.update_priorities("per", ids, np.ones(5)) == 5  # unary, no stream tried
        assert stream._session is None and calls == [5, 5, 5]
        client.close()
    finally:
        old.stop(0)


def test_a_server_from_before_call_streams_takes_updates_on_update_stream():
    """A server with UpdateStream but no CallStream (the version before): updates go on
    UpdateStream, inserts unary."""
    updates, inserts = [], []

    def stream(requests, context):
        for raw in requests:
            request = messages.decode_call_request(raw)
            updates.append(request.update_priorities.count)
            answer = pb.CallStreamResponse(sequence=request.sequence)
            answer.update_priorities.applied = request.update_priorities.count
            yield answer.SerializeToString()

    def insert(raw: bytes, context) -> bytes:
        inserts.append(messages.decode_insert(raw).table)
        return pb.InsertResponse(first_id=10, count=2).SerializeToString()

    def update(raw: bytes, context) -> bytes:
        unary.append(len(messages.decode_update(raw)[1]))
        return pb.UpdatePrioritiesResponse(applied=unary[-1]).SerializeToString()

    unary: list[int] = []
    old, port = _stand_in({"UpdateStream": grpc.stream_stream_rpc_method_handler(stream),
                           "Insert": grpc.unary_unary_rpc_method_handler(insert),
                           "UpdatePriorities": grpc.unary_unary_rpc_method_handler(update)})
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=10)
        ids = np.arange(3, dtype=np.int64)
        for _ in range(3):
            assert client.update_priorities("per", ids, np.ones(3)) == 3
        for _ in range(2):
            assert client.insert("per", {"x": torch.zeros(2)}).tolist() == [10, 11]
        assert unary == [3] and updates == [3, 3]  # the first update went unary
        assert inserts == ["per", "per"]
        assert client._stream("update_priorities")._session.method == "UpdateStream"
        assert client._stream("insert").supported is False
        client.close()
    finally:
        old.stop(0)


def test_closing_the_client_ends_its_stream(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(1)}, priorities=torch.ones(1))
    client.update_priorities("per", ids, torch.tensor([2.0]))
    session = client._call_streams["update_priorities"]._session
    client.close()
    assert session.closed and wait_for(session.call.done, timeout=5)
    assert client.update_priorities("per", ids, torch.tensor([3.0])) == 1  # reopens
    client.close()


def test_an_answer_later_than_the_timeout_raises_deadline_exceeded():
    def silent(requests, context):  # reads every request, answers none
        for _ in requests:
            pass
        return iter(())

    server_, port = _stand_in({"CallStream": grpc.stream_stream_rpc_method_handler(silent)})
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=1.0)
        with pytest.raises(errors.DeadlineExceededError, match="update_priorities within"):
            client.update_priorities("per", np.arange(3, dtype=np.int64), np.ones(3))
        client.close()
    finally:
        server_.stop(0)


def test_threads_see_one_error_each(server):
    """Two requests refused at once each get their own error, not each other's."""
    client = ReplayClient(server.address)
    results: list[BaseException] = []

    def bad(table: str) -> None:
        try:
            client.update_priorities(table, torch.tensor([0]), torch.tensor([1.0]))
        except errors.ReplayError as exc:
            results.append(exc)

    threads = [threading.Thread(target=bad, args=(t,)) for t in ("missing", "flat")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(type(e).__name__ for e in results) == ["NoPrioritiesError", "UnknownTableError"]
    client.close()


def test_an_update_larger_than_the_streams_messages_goes_unary(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(1000)}, priorities=torch.ones(1000))
    before = client.info()["per"].counters["priority_updates"]
    assert client.update_priorities("per", ids[:2], torch.full((2,), 3.0)) == 2  # on the stream
    many = ids.repeat(8)  # 8,000 ids: about 96 KB, over the stream's 64 KiB messages
    assert client.update_priorities("per", many, torch.full((8000,), 2.0)) == 8000
    session = client._call_streams["update_priorities"]._session
    assert session is not None and session.sequence == 1  # the large one did not go on it
    assert client.update_priorities("per", ids[:1], torch.tensor([7.0])) == 1  # the stream goes on
    assert session.sequence == 2 and client._call_streams["update_priorities"]._session is session
    assert client.info()["per"].counters["priority_updates"] == before + 8003
    client.close()
