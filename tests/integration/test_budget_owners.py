"""Every memory reservation has an owner that releases it, however its call ends.

Issue 34, item 1: a ``SampleStream`` whose call ended while a group of
batches was being sent (a reset, an ordinary connection cut) never gave its
group's reservation back: 21 resets of 20-row batches left 762 MiB of the
budget reserved, and once ~768 MiB had leaked every call over 1 MiB was
refused until a restart. Now every reservation a call makes belongs to the
call's own reservation, which gRPC's end-of-call callback releases on every
path (success, error, cancel, reset, cut, server stop).

Each test attacks a real server on loopback, then reads the budget in use
(``info``'s ``memory_in_use_bytes``) back at its idle value, and checks that
a legitimate learner on another connection still gets its batches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from replay_client import ReplayClient
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, module_server, wait_for
from tests.integration.raw_http2 import RawConnection

ROW_FLOATS = 64 << 10  # 256 KiB a row: a 20-row batch is 5 MiB, two messages
ROWS = 64
BATCH = 20
ATTACKS = 6
METHOD = "/replay.v1.ReplayService/SampleStream"

CONFIG = f"""
[server]
memory_budget_mb = 256
max_batch_mb = 64

[[tables]]
name = "big"
capacity = {ROWS}
"""

server = module_server(CONFIG)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as c:
        c.insert("big", {"obs": torch.randn(ROWS, ROW_FLOATS)})
        yield c


def in_use(client: ReplayClient) -> int:
    return client.server_info().limits["memory_in_use_bytes"]


def first_message(credits: int = 2) -> bytes:
    return pb.SampleStreamRequest(request=pb.SampleRequest(table="big", batch_size=BATCH),
                                  credits=credits).SerializeToString()


def assert_a_learner_is_served(client: ReplayClient) -> None:
    """A legitimate learner on its own connection takes three 20-row batches."""
    batches = 0
    for batch in client.stream("big", batch_size=BATCH, num_batches=3, prefetch=2):
        assert batch.ids.shape == (BATCH,)
        batches += 1
    assert batches == 3


def test_streams_reset_while_a_batch_is_sent_give_their_memory_back(
        client: ReplayClient, server: ServerProcess) -> None:
    idle = in_use(client)
    for _ in range(ATTACKS):
        with grpc.insecure_channel(server.address) as channel:
            held = threading.Event()

            def requests() -> Iterator[bytes]:
                yield first_message()
                held.wait(30)  # the stream stays open (no half-close) until it is reset

            call = channel.stream_stream(METHOD)(requests(), timeout=30)
            next(call)  # the first message of a two-message batch: the rest is being sent
            call.cancel()  # RST_STREAM mid-batch
            held.set()
        assert wait_for(lambda: in_use(client) == idle, timeout=20), (
            f"{in_use(client) - idle} bytes of the budget stayed reserved after a reset")
    print(f"{ATTACKS} resets mid-batch: memory_in_use_bytes back to {idle}")
    assert_a_learner_is_served(client)
    # the learner's stream ends as its call's end-of-call callback runs: awaited, not raced
    assert wait_for(lambda: in_use(client) == idle, timeout=20), in_use(client) - idle


def test_streams_cut_off_while_a_batch_is_sent_give_their_memory_back(
        client: ReplayClient, server: ServerProcess) -> None:
    idle = in_use(client)
    for _ in range(ATTACKS):
        raw = RawConnection(server.port)
        assert raw.handshake()
        raw.call(METHOD, first_message())
        # The server starts sending its 5 MiB batch into a window of 64 KiB nobody reads,
        # and holds the group's reservation while it waits: then the connection is cut.
        assert wait_for(lambda: in_use(client) > idle, timeout=20)
        raw.close()
        assert wait_for(lambda: in_use(client) == idle, timeout=20), (
            f"{in_use(client) - idle} bytes of the budget stayed reserved after a cut")
    print(f"{ATTACKS} connections cut mid-batch: memory_in_use_bytes back to {idle}")
    assert_a_learner_is_served(client)
    # the learner's stream ends as its call's end-of-call callback runs: awaited, not raced
    assert wait_for(lambda: in_use(client) == idle, timeout=20), in_use(client) - idle
