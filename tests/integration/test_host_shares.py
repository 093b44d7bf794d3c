"""One source address cannot take every call or stream slot (``server.max_host_share``).

Issue 34: the working, waiting and stream pools had global caps only, so one
host whose calls never spoke (or whose answers nobody read, or whose streams
idled) held a whole pool and every other host was refused meanwhile. Now the
calls of one address hold at most ``max_host_share`` (0.75) of each pool; past
it they are refused before anything of them is read, naming the address and
the setting, and a client from another address is served.

Raw HTTP/2 connections from 127.0.0.30 and 127.0.0.31 (other hosts as far as
the server can tell) hold the slots; the legitimate client on 127.0.0.1 uses
the replay client without retries. ``request_timeout_s`` is long here, so the
silent calls hold their slots until their connection closes (no clock decides
what the test sees).
"""

from __future__ import annotations

import re
import threading

import grpc
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, module_server, wait_for
from tests.integration.raw_http2 import RawConnection

SERVICE = "/replay.v1.ReplayService/"
WORKING, WAITING, STREAMS = 8, 16, 8  # shares at 0.75: 6, 12 and 6
FLOODER, SECOND = "127.0.0.30", "127.0.0.31"
DECLARED = (("replay-request-bytes", "100"),)

CONFIG = f"""
[server]
max_concurrent_calls = {WORKING}
max_waiting_calls = {WAITING}
max_streams = {STREAMS}
request_timeout_s = 60

[[tables]]
name = "steps"
capacity = 1000

[[tables]]
name = "gate"
capacity = 1000
min_size_to_sample = 50
"""

server = module_server(CONFIG)


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with ReplayClient(server.address, timeout=20, max_retry_s=0) as c:
        c.insert("steps", {"obs": torch.randn(100, 4)})
    # closed: its insert's call stream held a stream and a waiting slot, which the counts
    # below would see
    with ReplayClient(server.address, timeout=20, max_retry_s=0) as c:
        yield c


def limits(client: ReplayClient) -> dict:
    return client.server_info().limits


def refused_for_share(server: ServerProcess, source: str, held: int, setting: str,
                      cap: int, noun: str) -> bool:
    """Whether the server refused a call from ``source`` for its share (its log line)."""
    return re.search(
        rf"refused a call from ipv4:{re.escape(source)}:\d+: RESOURCE_EXHAUSTED \(overloaded\): "
        rf".*ipv4:{re.escape(source)} holds {held} of server\.{setting} = {cap} {noun} already "
        rf"\(server\.max_host_share = 0\.75: one address may hold {held}\)",
        server.log()) is not None


def silent(server: ServerProcess, source: str, method: str, count: int) -> RawConnection:
    """``count`` calls of ``method`` from ``source`` that never send a message."""
    raw = RawConnection(server.port, source=source)
    assert raw.handshake()
    for _ in range(count):
        raw.open_call(SERVICE + method, DECLARED)
    return raw


def idle(client: ReplayClient) -> bool:
    """Whether only the asking call holds a slot. Closing a flooder's connection frees its
    slots when the server has read the close: until then the pool may still be full, and the
    asking call itself is refused (not idle yet). The client's own call streams (its
    inserts') end with its close first."""
    client.close()
    try:
        now = limits(client)
    except errors.OverloadedError:
        return False
    return (now["calls_in_flight"], now["calls_waiting"], now["streams_open"]) == (1, 0, 0)


def test_one_address_holds_its_share_of_the_working_calls_and_another_is_served(
        server: ServerProcess, client: ReplayClient) -> None:
    flood = silent(server, FLOODER, "Insert", WORKING)  # 6 held, 2 refused
    second = None
    try:
        assert wait_for(lambda: refused_for_share(server, FLOODER, 6, "max_concurrent_calls",
                                                  WORKING, "working calls")), server.log()[-3000:]
        # The client on another address is served, beside the 6 the flooder holds.
        client.insert("steps", {"obs": torch.randn(10, 4)})
        now = limits(client)
        assert now["calls_in_flight"] == 7 and now["refused_calls_host_share"] >= 2
        assert client.sample("steps", 8).ids.shape == (8,)
        # Two addresses together fill the pool: then the client is refused, naming the cap.
        second = silent(server, SECOND, "Insert", WORKING - 6)

        def full() -> bool:
            try:
                client.info()
            except errors.OverloadedError as exc:
                assert "server.max_concurrent_calls = 8 calls already" in str(exc)
                return True
            second.open_call(SERVICE + "Insert", DECLARED)  # (the client's last call was
            return False                                    # still counted: one more)
        assert wait_for(full, timeout=20)
    finally:
        flood.close()
        if second is not None:
            second.close()
    assert wait_for(lambda: idle(client))  # closing the connections freed every slot


def test_one_address_holds_its_share_of_the_streams_and_a_learner_elsewhere_is_served(
        server: ServerProcess, client: ReplayClient) -> None:
    flood = silent(server, FLOODER, "SampleStream", STREAMS)  # 6 held, 2 refused
    try:
        assert wait_for(lambda: refused_for_share(server, FLOODER, 6, "max_streams", STREAMS,
                                                  "streams")), server.log()[-3000:]
        first = pb.SampleStreamRequest(request=pb.SampleRequest(
            table="steps", batch_size=4, num_batches=2), credits=2).SerializeToString()
        with grpc.insecure_channel(server.address) as channel:  # no retry: served at once
            answers = list(channel.stream_stream(SERVICE + "SampleStream")(iter([first]),
                                                                           timeout=20))
        assert len(answers) >= 2
        assert limits(client)["streams_open"] == 6  # the flooder's still held
    finally:
        flood.close()
    assert wait_for(lambda: idle(client))


def test_one_address_holds_its_share_of_the_waiting_calls_and_another_may_wait(
        server: ServerProcess, client: ReplayClient) -> None:
    """Unary calls enter the waiting pool when they start to wait (a sample waiting for
    data): that move is checked against the address's share too."""
    flood = RawConnection(server.port, source=FLOODER)
    assert flood.handshake()
    request = pb.SampleRequest(table="gate", batch_size=4).SerializeToString()
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(
        _sample_or_error(client, "gate")), daemon=True)
    try:
        # One call at a time: a call holds a working slot until it starts to wait, so calls
        # sent all at once could be refused for the working share (6) before the first waited.
        for sent in range(1, WAITING + 1):
            flood.call(SERVICE + "Sample", request)  # each waits for the gate's 50 rows
            waiting = min(sent, 12)
            assert wait_for(lambda: waiting_calls(client) == waiting), server.log()[-3000:]
        assert wait_for(lambda: refused_for_share(server, FLOODER, 12, "max_waiting_calls",
                                                  WAITING, "waiting calls")), server.log()[-3000:]
        assert waiting_calls(client) in (12, None)
        thread.start()  # the client's sample waits too, beside the flooder's 12
        assert wait_for(lambda: waiting_calls(client) == 13), outcome
        client.insert("gate", {"x": torch.zeros(50, 2)})
        thread.join(20)
        assert not thread.is_alive()
        assert outcome and not isinstance(outcome[0], BaseException), outcome
    finally:
        flood.close()
    assert wait_for(lambda: idle(client))


def waiting_calls(client: ReplayClient) -> int | None:
    """The server's count of waiting calls, or None while the asking call is refused."""
    try:
        return limits(client)["calls_waiting"]
    except errors.OverloadedError:
        return None


def _sample_or_error(client: ReplayClient, table: str) -> object:
    try:
        return client.sample(table, 4)
    except Exception as exc:  # the test asserts there is none
        return exc
