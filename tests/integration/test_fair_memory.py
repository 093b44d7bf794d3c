"""Memory waiters are served in turn per address: a crowd of large calls from one address
cannot starve another address's calls (issue 34, "reservations are granted fairly").

A real server with a 64 MiB budget (48 MiB for calls over 1 MiB: two 20 MiB inserts at
once) and 1 MiB messages (a chunked call's first message is a small reservation, taken
at once: the call queues once, to grow to its whole size). Every step waits for the server's own figures (``memory_in_use_bytes``,
``memory_waiting_calls``), never for time, so the outcome is fixed by construction:

1. two chunked inserts from 127.0.0.3 announce 20 MiB each and stall (raw HTTP/2): they
   hold the large calls' share;
2. four more from 127.0.0.3 queue for room, then a legitimate client on 127.0.0.1 inserts
   20 MiB with no retries of its own (``memory_wait_s`` is long: it waits, never times out);
3. one holder goes: the room fits one insert, and 127.0.0.3's oldest waiter takes it (its
   line came first) and stalls in turn;
4. the other holder goes: served in turn per address, the room is the legitimate
   client's. Served first come first served, 127.0.0.3's next waiter would take it, and the
   legitimate insert would wait behind every staller until refused.
"""

from __future__ import annotations

import threading

import torch

from replay_client import ReplayClient
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import grpc_calls_only, wait_for

from tests.integration.raw_http2 import RawConnection

_chunked = grpc_calls_only()  # the chunked path's budgets, as from another host

CONFIG = """
[server]
memory_budget_mb = 64
max_batch_mb = 24
max_message_mb = 1        # a chunked call's first message is small: it never queues
memory_wait_s = 600       # a waiter waits for its turn, however long the test's steps take
request_timeout_s = 600   # the stallers hold what they were granted until closed
keepalive_s = 3600        # and are not closed for leaving the server's pings unanswered

[[tables]]
name = "frames"
capacity = 64
"""
MIB = 1 << 20
ROWS, ROW_BYTES = 20, 1 << 20  # 20 MiB per insert: chunked
CROWD = 4
MESSAGE_BYTES = 1 << 10  # what each staller declares per message: it holds 20 MiB + 1 KiB


def stall(port: int) -> RawConnection:
    """A chunked insert of 20 MiB from 127.0.0.3 that announces itself and sends no more."""
    connection = RawConnection(port, source="127.0.0.3")
    assert connection.handshake()
    spec = pb.TensorSpec(key="pixels", dtype="uint8", shape=[ROWS, ROW_BYTES])
    first = pb.InsertRequest(table="frames", columns=[spec], payload_bytes=ROWS * ROW_BYTES)
    connection.send_first("/replay.v1.ReplayService/InsertChunks", first.SerializeToString(),
                          (("replay-request-bytes", str(MESSAGE_BYTES)),))
    return connection


def test_a_crowd_of_large_waiters_from_one_address_does_not_starve_another(
        server_factory) -> None:
    server = server_factory(CONFIG)
    stallers: list[RawConnection] = []
    with ReplayClient(server.address, timeout=600, max_retry_s=0, max_message_mb=1) as legit:
        def limits() -> dict[str, int]:
            return legit.server_info().limits

        try:
            holders = [stall(server.port) for _ in range(2)]
            stallers += holders
            assert wait_for(lambda: limits()["memory_in_use_bytes"] >= 40 * MIB, timeout=60)
            stallers += [stall(server.port) for _ in range(CROWD)]
            assert wait_for(lambda: limits()["memory_waiting_calls"] == CROWD, timeout=60)

            outcome: list[object] = []
            thread = threading.Thread(target=lambda: outcome.append(
                legit.insert("frames", {"pixels": torch.zeros(ROWS, ROW_BYTES,
                                                              dtype=torch.uint8)})))
            thread.start()
            assert wait_for(lambda: limits()["memory_waiting_calls"] == CROWD + 1, timeout=60)

            holders[0].close()  # room for one: 127.0.0.3's line came first
            assert wait_for(lambda: limits()["memory_waiting_calls"] == CROWD, timeout=60)
            assert thread.is_alive()  # the legitimate insert still waits for its turn
            holders[1].close()  # room for one more: 127.0.0.1's turn
            thread.join(60)  # served first come first served, it would still wait
            assert not thread.is_alive()
            assert len(outcome) == 1 and len(outcome[0]) == ROWS  # stored, never refused
            assert legit.info()["frames"].size == ROWS
        finally:
            for connection in stallers:
                connection.close()
        assert wait_for(lambda: limits()["memory_in_use_bytes"] == 0, timeout=60)
        assert limits()["memory_waiting_calls"] == 0
