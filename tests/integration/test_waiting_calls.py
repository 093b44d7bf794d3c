"""Waiting calls have a pool of their own and a finite default wait; a real server process.

Issue 23, finding 5: 256+ clients waiting (``fetch(newer_than=...)`` with its
default ``timeout=None``, ``sample(wait=True)``, idle streams) filled
``max_concurrent_calls``: the ``insert``, ``info`` and ``publish`` that would
have released them all got ``OverloadedError``, and with no timeout it never
cleared. Now a stream counts in ``max_waiting_calls`` from its start, and a
unary call moves there when it starts to wait, leaving the working slots to
the calls that release the waiters; a waiting call whose client set no
deadline waits ``default_wait_s`` at most.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto.v1 import replay_pb2 as pb
from replay_proto.v1 import replay_pb2_grpc
from tests.conftest import module_server, wait_for

WORKING = 8
WAITING = 60
STREAMS = 4
DEFAULT_WAIT_S = 2.0
JOIN_S = 60

CONFIG = f"""
[server]
max_concurrent_calls = {WORKING}
max_waiting_calls = {WAITING}
max_streams = {STREAMS}
default_wait_s = {DEFAULT_WAIT_S}
max_host_share = 1.0  # the pools' own caps, all calls from 127.0.0.1

[[tables]]
name = "replay"
capacity = 1000

[[tables]]
name = "empty"
capacity = 1000

[[tables]]
name = "gate"
capacity = 1000
min_size_to_sample = 500

[[tables]]
name = "never"
capacity = 1000
"""

served = module_server(CONFIG)


class Waiters:
    """Threads each making one call that waits, collecting how each ended."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.outcomes: list[object] = []

    def start(self, fn, count: int) -> None:
        for _ in range(count):
            def run() -> None:
                try:
                    self.outcomes.append(fn())
                except BaseException as exc:  # every outcome is checked by the test
                    self.outcomes.append(exc)
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(JOIN_S)
        assert not any(t.is_alive() for t in self.threads)


def _sample_once(address: str, table: str, **kwargs):
    """One sample by a client of its own, closed after it (a same-host client's sample call
    stream, which would wait in the pool for its next request, ends with it)."""
    with ReplayClient(address, timeout=30) as client:
        return client.sample(table, 4, **kwargs)


def waiting(client: ReplayClient) -> int:
    """Calls in the waiting pool, or -1 (no count matches) where the asking call itself was
    refused: a call's working slot is freed by a callback after its answer went out, so on
    a loaded machine the calls just answered may still hold the 8 working slots for a
    moment (a clean-clone CI: the waiters' own first calls), and this client does not
    retry."""
    try:
        return client.server_info().limits["calls_waiting"]
    except errors.OverloadedError:
        return -1


def test_waiters_never_take_the_slots_of_the_calls_that_release_them(served) -> None:
    client = ReplayClient(served.address, timeout=30, max_retry_s=0)
    version = client.publish("policy", {"w": torch.zeros(3)})
    waiters = Waiters()
    waiters.start(lambda: ReplayClient(served.address, timeout=40).fetch(
        "policy", newer_than=version, timeout=30), 20)
    waiters.start(lambda: _sample_once(served.address, "gate"), 15)
    waiters.start(lambda: _sample_once(served.address, "empty", wait=True), 15)
    assert wait_for(lambda: waiting(client) >= 50, timeout=JOIN_S)  # 6 times WORKING
    # With every waiter waiting, the calls that release them are served: no OverloadedError.
    assert client.info()["gate"].rate_limiter["blocked_samples"] == 15
    client.insert("gate", {"x": torch.zeros(500, 2)})
    client.insert("empty", {"x": torch.zeros(10, 2)})
    client.publish("policy", {"w": torch.ones(3)})
    waiters.join()
    fetched = [o for o in waiters.outcomes if isinstance(o, dict)]
    assert len(fetched) == 20 and all(v.version == version + 1 for v in fetched)
    assert len(waiters.outcomes) == 50
    assert not [o for o in waiters.outcomes if isinstance(o, BaseException)]
    client.close()  # its inserts' call stream waits in the pool too, until it ends
    assert wait_for(lambda: waiting(client) == 0)


def test_a_full_waiting_pool_refuses_the_next_waiter_naming_the_limit(served) -> None:
    client = ReplayClient(served.address, timeout=30, max_retry_s=0)
    version = client.publish("full", {"w": torch.zeros(1)})
    waiters = Waiters()
    waiters.start(lambda: ReplayClient(served.address, timeout=40).fetch(
        "full", newer_than=version, timeout=30), WAITING)
    try:
        assert wait_for(lambda: waiting(client) == WAITING, timeout=JOIN_S)
        with pytest.raises(errors.OverloadedError, match="server.max_waiting_calls = 60"):
            client.fetch("full", newer_than=version, timeout=30)
        # Working calls are still served. A client that retries, as by default: a call's
        # working slot is freed by a callback after its answer went out, and on a loaded
        # machine (a clean-clone CI at load ~30) the calls just answered (the refused
        # fetch, the waiters' own first calls) still held the 8 slots for a moment.
        with ReplayClient(served.address, timeout=30) as retrying:
            assert retrying.info()["replay"].size >= 0
    finally:  # the waiters leave the pool whatever happened (the next test needs it)
        client.publish("full", {"w": torch.ones(1)})
        waiters.join()
    assert sum(isinstance(o, dict) for o in waiters.outcomes) == WAITING


def test_streams_are_capped_within_the_pool_and_waiters_are_not(served) -> None:
    """A stream reads messages all its life (gRPC may hold a whole one for it), a waiting
    unary call has read its request: streams, not waiters, are what the memory bound counts
    (docs/service.md, "Limits"), so they have a cap of their own (``max_streams``) inside the
    waiting pool, and the pool's other waiters are admitted past it."""
    client = ReplayClient(served.address, timeout=30, max_retry_s=0)
    version = client.publish("streams", {"w": torch.zeros(1)})
    client.insert("replay", {"x": torch.zeros(4, 2)})
    client.close()  # its insert's call stream is a stream too: ended before the count
    assert wait_for(lambda: client.server_info().limits["streams_open"] == 0, timeout=JOIN_S)
    done = threading.Event()

    def idle():  # a learner's stream between batches: its one credit spent, open
        yield pb.SampleStreamRequest(request=pb.SampleRequest(table="replay", batch_size=1),
                                     credits=1)
        done.wait(60)

    with grpc.insecure_channel(served.address) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        streams = [stub.SampleStream(idle(), timeout=60) for _ in range(STREAMS)]
        try:
            assert wait_for(lambda: client.server_info().limits["streams_open"] == STREAMS,
                            timeout=JOIN_S)
            refused = stub.SampleStream(idle(), timeout=60)
            with pytest.raises(grpc.RpcError) as caught:
                next(refused)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "server.max_streams = 4" in caught.value.details()
            # The pool itself has room: unary waiters are admitted past the streams' cap.
            waiters = Waiters()
            waiters.start(lambda: ReplayClient(served.address, timeout=40).fetch(
                "streams", newer_than=version, timeout=30), 10)
            assert wait_for(lambda: waiting(client) == STREAMS + 10, timeout=JOIN_S)
            client.publish("streams", {"w": torch.ones(1)})
            waiters.join()
            assert sum(isinstance(o, dict) for o in waiters.outcomes) == 10
        finally:
            done.set()
            for stream in streams:
                stream.cancel()
    assert wait_for(lambda: client.server_info().limits["streams_open"] == 0)
    assert wait_for(lambda: waiting(client) == 0)


def test_a_waiting_call_without_a_deadline_waits_the_default_at_most(served) -> None:
    client = ReplayClient(served.address, timeout=None, max_retry_s=0)
    version = client.publish("quiet", {"w": torch.zeros(1)})
    started = time.monotonic()
    assert client.fetch("quiet", newer_than=version, timeout=None) is None
    with pytest.raises(errors.DeadlineExceededError):
        client.sample("never", 4, wait=True)
    assert time.monotonic() - started < JOIN_S


@pytest.mark.slow
def test_the_reported_waiters_at_full_size(tmp_path) -> None:
    """The report's size against the default limits: 300 waiters (more than the 256 working
    slots), then the insert, info and publish that release them."""
    from tests.conftest import start_server

    server = start_server(tmp_path, "[[tables]]\nname = \"gate\"\ncapacity = 1000\n"
                                    "min_size_to_sample = 500\n")
    try:
        client = ReplayClient(server.address, timeout=60, max_retry_s=0)
        version = client.publish("policy", {"w": torch.zeros(3)})
        waiters = Waiters()
        waiters.start(lambda: ReplayClient(server.address, timeout=120).fetch(
            "policy", newer_than=version, timeout=90), 200)
        waiters.start(lambda: ReplayClient(server.address, timeout=90).sample("gate", 4), 100)
        assert wait_for(lambda: waiting(client) >= 300, timeout=120)
        assert client.info()["gate"].rate_limiter["blocked_samples"] == 100
        client.insert("gate", {"x": torch.zeros(500, 2)})
        client.publish("policy", {"w": torch.ones(3)})
        waiters.join()
        assert not [o for o in waiters.outcomes if isinstance(o, BaseException)]
    finally:
        assert server.stop() == 0
