"""A call's working slot is free again when its answer is out; a real server process.

A client that waits for each answer before its next call holds one slot at
most. The slot used to be given back by gRPC's end-of-call callback, which
runs after the call's status went out: on a loaded machine the client's next
call could arrive first and, at ``max_concurrent_calls = 1`` (or with every
other slot busy), be refused "1 calls already" for its own finished call. A
client without retries (``max_retry_s=0``) saw it as an error. Now the slot is
given back when the handler has written its answer, before the status.
"""

from __future__ import annotations

import torch

from replay_client import ReplayClient
from tests.conftest import module_server

CALLS = 150  # of each kind, one at a time

CONFIG = """
[server]
max_concurrent_calls = 1
max_host_share = 1.0

[[tables]]
name = "steps"
capacity = 1000
"""

server = module_server(CONFIG)


def test_one_call_at_a_time_is_never_refused_for_the_call_before(server) -> None:
    with ReplayClient(server.address, timeout=20, max_retry_s=0) as client:
        for _ in range(CALLS):
            client.insert("steps", {"obs": torch.randn(4, 3)})
            client.sample("steps", 2)
            client.info()
        assert client.info()["steps"].size == 4 * CALLS  # (under the capacity)
        assert client.server_info().limits["refused_calls"] == 0
