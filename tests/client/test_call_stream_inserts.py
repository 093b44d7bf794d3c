"""Small inserts on the client's CallStream: never stored twice, never silently lost.

The server reads a stream's next request only once it has answered the one
before, so when a stream breaks only its oldest unanswered request may have
been applied. An insert in that place raises UnavailableError ("may or may
not"), as a unary insert whose connection broke does; an insert the server
never handled (the stream refused at admission, or ended by a draining
server) goes unary instead, exactly once. Stand-in servers play the
failures; a real server shows the ordinary path.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from replay_client import ReplayClient, call_stream, errors
from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import module_server, wait_for

CONFIG = """
[[tables]]
name = "t"
capacity = 100000

[[tables]]
name = "held"
capacity = 100
min_size_to_sample = 2
samples_per_insert = 1.0
error_buffer = 1.0
"""

server = module_server(CONFIG)


def _stand_in(stream, gone: bool = False) -> tuple[grpc.Server, int, list[str]]:
    """A server whose CallStream is ``stream(requests, context)`` and whose unary Insert
    stores nothing but is counted (the list returned), or (``gone``) fails UNAVAILABLE as a
    server that went away."""
    unary: list[str] = []

    def insert(raw: bytes, context) -> bytes:
        if gone:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        unary.append(messages.decode_insert(raw).table)
        return pb.InsertResponse(first_id=100, count=2).SerializeToString()

    stand_in = grpc.server(futures.ThreadPoolExecutor(4))
    stand_in.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "replay.v1.ReplayService", {"CallStream": grpc.stream_stream_rpc_method_handler(stream),
                                    "Insert": grpc.unary_unary_rpc_method_handler(insert)}),))
    port = stand_in.add_insecure_port("127.0.0.1:0")
    stand_in.start()
    return stand_in, port, unary


ROWS = {"x": torch.zeros(2)}


def test_small_inserts_go_on_one_stream_with_the_same_ids_and_rows_as_unary(server, monkeypatch):
    monkeypatch.setenv("REPLAY_SHARED_MEMORY", "0")  # a large insert then goes unary
    client = ReplayClient(server.address)
    client.reset("t")
    on_stream = [client.insert("t", {"x": torch.full((3,), float(k))}) for k in range(4)]
    session = client._stream("insert")._session
    assert session is not None and session.sequence == 4  # all four on one call
    large = client.insert("t", {"x": torch.zeros(20_000)})  # 80 KB: over the stream's 64 KiB
    assert session.sequence == 4  # so it went unary
    assert client.insert("t", {"x": torch.zeros(1)}).numel() == 1 and session.sequence == 5
    ids = torch.cat([*on_stream, large])
    assert ids.tolist() == list(range(int(ids[0]), int(ids[0]) + 12 + 20_000))
    read = client.read("t", ids=ids[:12])
    assert read.columns["x"].tolist() == [float(k) for k in range(4) for _ in range(3)]
    client.close()


def test_an_insert_in_the_servers_hands_when_the_stream_breaks_is_in_doubt_not_resent():
    def breaks(requests, context):
        next(requests)  # the insert is in hand: the server goes away
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")

    stand_in, port, unary = _stand_in(breaks)
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=10)
        with pytest.raises(errors.UnavailableError, match="may or may not have been applied"):
            client.insert("t", ROWS)
        assert unary == []  # not sent again: it may be stored already
        client.close()
    finally:
        stand_in.stop(0)


def test_an_insert_a_draining_server_did_not_handle_goes_unary_once():
    def drains(requests, context):
        next(requests)  # read, but a draining server answers UNAVAILABLE before handling
        context.set_trailing_metadata((("replay-error-kind", "unavailable"),))
        context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    stand_in, port, unary = _stand_in(drains)
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=10)
        assert client.insert("t", ROWS).tolist() == [100, 101]
        assert unary == ["t"]
        client.close()
    finally:
        stand_in.stop(0)


def test_a_refused_stream_sends_its_insert_unary_and_is_not_asked_again_for_a_while():
    opened = []

    def refuses(requests, context):
        opened.append(1)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      "2 call streams (half of server.max_streams) are open already")

    stand_in, port, unary = _stand_in(refuses)
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=10)
        for _ in range(3):
            assert client.insert("t", ROWS).tolist() == [100, 101]
        assert unary == ["t"] * 3 and opened == [1]  # one stream tried, then unary only
        client.close()
    finally:
        stand_in.stop(0)


def test_a_refused_insert_raises_its_type_and_the_stream_goes_on(server):
    client = ReplayClient(server.address)
    client.reset("t")
    client.insert("t", {"x": torch.zeros(1)})
    session = client._stream("insert")._session
    size = client.info()["t"].size
    with pytest.raises(errors.SchemaMismatchError):
        client.insert("t", {"y": torch.zeros(1)})
    with pytest.raises(errors.UnknownTableError):
        client.insert("nope", {"x": torch.zeros(1)})
    assert client.insert("t", {"x": torch.ones(2)}).numel() == 2
    assert client._stream("insert")._session is session and session.sequence == 4
    assert client.info()["t"].size == size + 2  # the refused ones stored nothing
    client.close()


def test_an_insert_held_by_its_rate_limiter_never_holds_another_threads_insert(server):
    """One insert waits on the stream for its table's rate limiter; another thread's insert
    into another table meanwhile goes unary and is stored at once, not after it."""
    client = ReplayClient(server.address, timeout=30)
    client.reset("held")
    client.insert("held", {"x": torch.zeros(3)})  # filling up is free; now at the top
    held: list[object] = []
    waiting = threading.Thread(target=lambda: held.append(
        client.insert("held", {"x": torch.zeros(1)})), daemon=True)
    waiting.start()
    stream = client._stream("insert")
    assert wait_for(lambda: stream._session is not None and len(stream._session.pending) == 1)
    started = time.monotonic()
    assert client.insert("t", {"x": torch.zeros(2)}).numel() == 2
    assert time.monotonic() - started < 10 and waiting.is_alive()  # not behind the held one
    client.sample("held", 2)  # the learner catches up: the held insert passes
    waiting.join(20)
    assert not waiting.is_alive() and held and held[0].numel() == 1
    client.close()


def test_a_draining_servers_own_refusal_is_what_the_caller_sees():
    """The server answers the insert UNAVAILABLE itself (draining) and is gone for the unary
    call that follows: the caller gets the server's words, as a unary insert would have."""
    def drains(requests, context):
        for raw in requests:
            request = messages.decode_call_request(raw)
            answer = pb.CallStreamResponse(sequence=request.sequence)
            answer.error.code, answer.error.kind = "UNAVAILABLE", "unavailable"
            answer.error.message = "the server is shutting down"
            yield answer.SerializeToString()

    stand_in, port, _ = _stand_in(drains, gone=True)
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout=10, max_retry_s=0)
        with pytest.raises(errors.UnavailableError, match="shutting down"):
            client.insert("t", ROWS)
        client.close()
    finally:
        stand_in.stop(0)


def test_an_idle_stream_is_ended_and_the_next_insert_opens_another(server, monkeypatch):
    """Nothing sent for IDLE_CLOSE_S: the client ends its stream, so the server holds no
    slot and no memory for an actor that stopped inserting."""
    monkeypatch.setattr(call_stream, "IDLE_CLOSE_S", 0.3)
    client = ReplayClient(server.address, timeout=2.0)  # its watchdog looks every 0.5 s
    client.insert("t", ROWS)
    first = client._stream("insert")._session
    assert first is not None
    assert wait_for(lambda: client.server_info().limits["streams_open"] == 0, timeout=10)
    assert first.closed and client._stream("insert")._session is None
    assert client.insert("t", ROWS).numel() == 2
    assert client._stream("insert")._session not in (None, first)
    client.close()
