"""Legitimate clients are never cut for rapid reset (issue 34, item 3).

The rapid-reset meter (``server.max_call_resets_per_s``) cuts a connection that ends calls
before their first message arrived. What legitimate clients do must never count: a learner
closing its streams, calls with deadlines that run out while they wait on the server, calls
the server itself refuses while they wait for memory. Here the limit is 1 a second, its
least, so that two such ends from one connection within a second would cut it: each test
checks the client saw no ``UnavailableError`` and the server logged no cut.
"""

from __future__ import annotations


import torch

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, module_server, run_threads

CONFIG = """
[server]
max_call_resets_per_s = 1
max_batch_mb = 4
memory_budget_mb = 16     # 12 MiB for calls over 1 MiB: one 5 MiB insert (and its message) at once
memory_wait_s = 0.01      # the others are refused after waiting 10 ms for room

[[tables]]
name = "steps"
capacity = 1000

[[tables]]
name = "empty"
capacity = 10

[[tables]]
name = "frames"
capacity = 8
"""
CUT = "ended more than server.max_call_resets_per_s"

server = module_server(CONFIG)


def assert_never_cut(server: ServerProcess) -> None:
    assert CUT not in server.log()


def test_a_learner_closing_its_streams_is_not_cut(server: ServerProcess) -> None:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as client:
        client.insert("steps", {"x": torch.randn(100, 4)})
        for _ in range(20):  # 20 streams opened and closed within seconds on one connection
            stream = client.stream("steps", 8, prefetch=2)
            next(iter(stream))
            stream.close()
        client.info()
    assert_never_cut(server)


def test_calls_whose_deadlines_run_out_on_the_server_are_not_cut(server: ServerProcess) -> None:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as client:
        outcomes: list[BaseException] = []

        def waiter() -> None:
            try:
                client.sample("empty", 1, wait=True, timeout=1.0)  # nothing comes: times out
            except errors.ReplayError as exc:
                outcomes.append(exc)

        run_threads(waiter, 16, timeout=60)
        assert len(outcomes) == 16
        assert all(isinstance(exc, errors.DeadlineExceededError) for exc in outcomes), outcomes
        client.info()
    assert_never_cut(server)


def test_calls_the_server_refuses_for_memory_are_not_cut(server: ServerProcess) -> None:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as client:
        refused, failed = [], []

        def inserter() -> None:
            for _ in range(4):
                try:
                    client.insert("frames", {"x": torch.zeros(5, 1 << 18)})  # 5 MiB: chunked
                except errors.OverloadedError as exc:
                    refused.append(exc)
                except errors.ReplayError as exc:
                    failed.append(exc)

        run_threads(inserter, 8, timeout=120)
        print(f"\n{len(refused)} of 32 inserts refused for memory; other errors: {failed}")
        assert failed == []
        assert len(refused) >= 2  # enough to be cut at 1 a second, had they counted
        client.info()
    assert_never_cut(server)
