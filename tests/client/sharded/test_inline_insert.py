"""A sharded insert whose rows all go to one shard runs on the caller's thread (its shard's
lane, ``replay_client.sharded.lanes``) with the pooled path's rows, ids, per-shard deadline
and errors.

Real server processes on 127.0.0.1; a shard stopped with SIGSTOP (continued in ``finally``)
stands for a hung one, a rate-limited insert for a slow but live one. Calls that may hang run
on a thread and must return by an event's deadline far below the clients' 60 s timeout.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from replay_client import ReplayClient, errors
from replay_client.connection import Connection
from replay_client.server_client import ServerClient
from replay_client.sharded.placement import by_episode

from tests.conftest import start_server, wait_for
from tests.client.sharded.bounded import returns_within

DEADLINE_S = 0.5
"""The clients' per-shard deadline."""

BOUND_S = 2 * DEADLINE_S + 10.0
"""How long a call to a hung shard may take: the deadline, a probe as long, a wide margin."""

TIMEOUT_S = 60.0

CONFIG = """
[server]
shard = {shard}

[[tables]]
name = "u"
capacity = 1000
sampler = "uniform"

[[tables]]
name = "limited"
capacity = 1000
sampler = "uniform"
min_size_to_sample = 2
samples_per_insert = 1.0
error_buffer = 1.0
"""


def _returns(call: Callable[[], Any], bound: float = BOUND_S) -> Any:
    return returns_within(call, bound)


class _ThreadNoting(ServerClient):
    """A one-server client that notes the thread each of its inserts ran on."""

    threads: list[str] = []

    def insert(self, table: str, data: Any, priorities: Any = None) -> torch.Tensor:
        type(self).threads.append(threading.current_thread().name)
        return super().insert(table, data, priorities)


def _rows(n: int, episode: int | None = None, first: float = 0.0) -> dict[str, torch.Tensor]:
    rows = {"obs": torch.arange(first, first + n * 3, dtype=torch.float32).reshape(n, 3),
            "action": torch.arange(n) % 6}
    if episode is not None:
        rows["episode"] = torch.full((n,), episode, dtype=torch.int64)
    return rows


def _episode_on(shard: int, shards: list[int]) -> int:
    """An episode id that placement puts on ``shard``."""
    for episode in range(1000):
        if shard in by_episode(np.array([episode], dtype=np.int64), shards):
            return episode
    raise AssertionError(f"no episode below 1000 goes to shard {shard}")


@pytest.fixture
def servers(tmp_path):
    started = []

    def start(count: int) -> list:
        started.extend(start_server(tmp_path, CONFIG.format(shard=s), name=f"s{s}")
                       for s in range(count))
        return started

    yield start
    for server in started:
        server.stop()


def test_a_one_shard_insert_runs_on_the_callers_thread_with_the_rows_and_ids_of_one_server(
        servers):
    (server,) = servers(1)
    _ThreadNoting.threads = []
    with ReplayClient(server.address) as plain, ReplayClient(
            [server.address], client=_ThreadNoting, shard_deadline_s=DEADLINE_S) as sharded:
        before = plain.insert("u", _rows(4))
        data = _rows(64, first=100.0)
        ids = sharded.insert("u", data)
        after = plain.insert("u", _rows(4))
        assert ids.tolist() == list(range(int(before[-1]) + 1, int(before[-1]) + 65))
        assert int(after[0]) == int(ids[-1]) + 1  # the same id sequence as one server's
        read = sharded.read("u", ids=ids)
        assert torch.equal(read.ids, ids)
        assert torch.equal(read.columns["obs"], data["obs"])
        assert torch.equal(read.columns["action"], data["action"])
    assert _ThreadNoting.threads == [threading.current_thread().name]


def test_an_episode_on_one_of_two_shards_is_inserted_inline_and_one_spanning_both_is_pooled(
        servers):
    addresses = [s.address for s in servers(2)]
    _ThreadNoting.threads = []
    one = _episode_on(1, [0, 1])
    with ReplayClient(addresses, client=_ThreadNoting, shard_deadline_s=DEADLINE_S) as sharded:
        sharded.info()  # connects (asks each server its index)
        data = _rows(8, episode=one)
        ids = sharded.insert("u", data)
        assert set((ids >> 56).tolist()) == {1}
        assert torch.equal(sharded.read("u", ids=ids).columns["obs"], data["obs"])
        assert _ThreadNoting.threads == [threading.current_thread().name]

        other = _episode_on(0, [0, 1])
        both = {k: torch.cat([a, b]) for (k, a), b in
                zip(_rows(4, episode=one).items(), _rows(4, episode=other, first=50.0).values())}
        mixed = sharded.insert("u", both)
        assert (mixed >> 56).tolist() == [1] * 4 + [0] * 4  # ids in row order
        assert torch.equal(sharded.read("u", ids=mixed).columns["obs"], both["obs"])
        assert threading.current_thread().name not in _ThreadNoting.threads[1:]


def test_a_strict_one_shard_insert_to_a_stopped_shard_fails_as_late_then_works_again(servers):
    (server,) = servers(1)
    client = ReplayClient([server.address], timeout=TIMEOUT_S, shard_deadline_s=DEADLINE_S)
    stopped = False
    try:
        assert client.insert("u", _rows(4)).numel() == 4
        server.process.send_signal(signal.SIGSTOP)
        stopped = True
        with pytest.raises(errors.UnavailableError, match=r"shard 0 \(127\.0\.0\.1:\d+\) did not "
                                                          r"answer within the per-shard deadline"):
            _returns(lambda: client.insert("u", _rows(4)))
        server.process.send_signal(signal.SIGCONT)
        stopped = False
        ids = _returns(lambda: client.insert("u", _rows(4)))  # on a new lane
        assert ids.numel() == 4 and set((ids >> 56).tolist()) == {0}
        assert client.info()["u"].size in (8, 12)  # the late insert may have been stored
    finally:
        if stopped:
            server.process.send_signal(signal.SIGCONT)
        client.close()


def test_a_degraded_client_resends_a_stopped_shards_episode_to_the_live_one(servers):
    started = servers(2)
    addresses = [s.address for s in started]
    client = ReplayClient(addresses, allow_degraded=True, timeout=TIMEOUT_S,
                          shard_deadline_s=DEADLINE_S)
    episode = _episode_on(1, [0, 1])
    stopped = False
    try:
        assert set((client.insert("u", _rows(4, episode=episode)) >> 56).tolist()) == {1}
        started[1].process.send_signal(signal.SIGSTOP)
        stopped = True
        data = _rows(6, episode=episode, first=10.0)
        ids = _returns(lambda: client.insert("u", data))
        assert set((ids >> 56).tolist()) == {0}  # resent to the live shard
        assert torch.equal(client.read("u", ids=ids).columns["obs"], data["obs"])
        assert 1 in client.shard_stats().down
        started[1].process.send_signal(signal.SIGCONT)
        stopped = False
        assert wait_for(lambda: 1 not in client.shard_stats().down, timeout=30)
        ids = _returns(lambda: client.insert("u", _rows(2, episode=episode)))
        assert set((ids >> 56).tolist()) == {1}
    finally:
        if stopped:
            started[1].process.send_signal(signal.SIGCONT)
        client.close()


def test_a_slow_but_live_shard_is_waited_for_past_the_deadline(servers):
    """An insert the rate limiter holds for longer than the deadline: the probe answers, so
    the insert waits (its own timeout) and succeeds once a sample lets it in."""
    (server,) = servers(1)
    released = threading.Event()
    with ReplayClient(server.address) as direct, ReplayClient(
            [server.address], timeout=TIMEOUT_S, shard_deadline_s=DEADLINE_S) as sharded:
        direct.insert("limited", _rows(4))  # the limiter's window is full now

        def release() -> None:
            time.sleep(4 * DEADLINE_S)  # the insert waits past its deadline and its probe
            released.set()
            direct.sample("limited", 2)

        threading.Thread(target=release, daemon=True).start()
        ids = _returns(lambda: sharded.insert("limited", _rows(2)), bound=TIMEOUT_S)
        assert released.is_set()  # it could only get in after the sample
        assert ids.numel() == 2
        assert not sharded.shard_stats().down


def test_a_cancelled_connection_refuses_its_calls_with_the_reason(servers):
    (server,) = servers(1)
    with ReplayClient(server.address) as client:
        client.info()
        connection = Connection(server.address, timeout=5.0, token=None, max_message_mb=4,
                                max_retry_s=0.5)
        connection.cancel("given up")
        with pytest.raises(errors.UnavailableError, match="given up"):
            connection.unary("Info", b"", retry=True)


def test_threads_sharing_a_stopped_shards_lane_all_fail_as_late_then_all_insert(servers):
    """Four threads insert inline on one shard's lane at once: each gets its own ids; with the
    shard stopped, each fails as late (the lane is cancelled under all of them); after it
    continues, a new lane takes them all."""
    (server,) = servers(1)
    client = ReplayClient([server.address], timeout=TIMEOUT_S, shard_deadline_s=DEADLINE_S)

    def together(count: int = 4) -> list[Any]:
        results: list[Any] = [None] * count
        barrier = threading.Barrier(count)

        def insert(i: int) -> None:
            barrier.wait(BOUND_S)
            try:
                results[i] = client.insert("u", _rows(8, first=100.0 * i))
            except errors.ReplayError as exc:
                results[i] = exc

        threads = [threading.Thread(target=insert, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(BOUND_S)
            assert not thread.is_alive(), f"an insert did not return within {BOUND_S} s"
        return results

    stopped = False
    try:
        ids = together()
        assert len(set(torch.cat(ids).tolist())) == 32
        server.process.send_signal(signal.SIGSTOP)
        stopped = True
        for result in together():
            assert isinstance(result, errors.UnavailableError), result
            assert "did not answer within the per-shard deadline" in str(result)
        server.process.send_signal(signal.SIGCONT)
        stopped = False
        ids = together()
        assert all(isinstance(i, torch.Tensor) and i.numel() == 8 for i in ids)
    finally:
        if stopped:
            server.process.send_signal(signal.SIGCONT)
        client.close()
