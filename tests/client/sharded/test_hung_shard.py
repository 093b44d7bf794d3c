"""A hung shard costs a sharded call the per-shard deadline, never the call's timeout (issue 34,
item 8), and a shard's sampling mass is checked before it is merged.

A black-hole listener (127.0.0.1, port 0: accepts TCP, never speaks) and a real server
stopped with SIGSTOP after it joined stand for hung shards. Each call runs on a thread and
must return by an event's deadline (twice the per-shard deadline plus a margin), far below
the clients' 60 s timeout that every call waited for before.
"""

from __future__ import annotations

import math
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from replay_client import ReplayClient, errors
from replay_client.sharded.merge import MassBook, merge_into, shares, split
from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer

from tests.conftest import start_server, wait_for
from tests.client.sharded.bounded import returns_within

DEADLINE_S = 0.5
"""The clients' per-shard deadline."""

BOUND_S = 2 * DEADLINE_S + 10.0
"""How long a call may take with a hung shard: the deadline, a probe as long, and a wide
margin for a loaded machine (without the per-shard deadline: the 60 s timeout)."""

TIMEOUT_S = 60.0


def _returns(call: Callable[[], Any], bound: float = BOUND_S) -> Any:
    return returns_within(call, bound)


@pytest.fixture
def black_hole() -> Iterator[str]:
    """The address of a listener that accepts connections and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()
    for conn in held:
        conn.close()


@pytest.fixture
def shard0() -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(settings_from_dict({
        "server": {"address": "127.0.0.1:0", "shard": 0, "shared_memory": False},
        "tables": [{"name": "u", "capacity": 100, "sampler": "uniform"}]}))
    yield server
    server.close()


def test_a_black_hole_in_the_list_is_left_out_and_reported_missing(shard0, black_hole):
    with ReplayClient(shard0.address) as direct:
        direct.insert("u", {"x": torch.arange(8)})
    client = ReplayClient([shard0.address, black_hole], allow_degraded=True,
                          timeout=TIMEOUT_S, shard_deadline_s=DEADLINE_S)
    try:
        assert _returns(client.info)["u"].size == 8
        ids = _returns(lambda: client.insert("u", {"x": torch.arange(4)}))
        assert set((ids >> 56).tolist()) == {0}
        batch = _returns(lambda: client.sample("u", 16))
        assert batch.batch_size == 16 and batch.missing_shards == (1,)
        assert set((batch.ids >> 56).tolist()) == {0}
    finally:
        client.close()


def test_a_degraded_client_asks_a_silent_new_server_in_the_background(shard0, black_hole):
    """A black hole that appears under the name is asked its index by a background
    resolution: no caller waits the per-shard deadline (8 s here) for it."""
    names = [shard0.address]
    asked = threading.Event()

    def resolver(host: str, port: int) -> list[str]:
        if len(names) > 1:
            asked.set()
        return list(names)

    client = ReplayClient("shards://replay:50051", resolver=resolver, allow_degraded=True,
                          timeout=TIMEOUT_S, shard_deadline_s=8.0, resolve_interval_s=0.1)
    try:
        client.insert("u", {"x": torch.arange(4)})
        names.append(black_hole)
        for _ in range(200):  # a call soon finds the resolution due: it starts it
            _returns(client.info, bound=5.0)
            if asked.wait(0.05):
                break
        assert asked.is_set()
        for _ in range(3):  # while the black hole is being asked (8 s), calls go on
            assert _returns(client.info, bound=5.0)["u"].size >= 4
            assert set((_returns(lambda: client.insert("u", {"x": torch.arange(2)}),
                                 bound=5.0) >> 56).tolist()) == {0}
            assert _returns(lambda: client.sample("u", 4), bound=5.0).batch_size == 4
    finally:
        client.close()


def test_a_strict_client_refuses_a_black_hole_naming_it(shard0, black_hole):
    client = ReplayClient([shard0.address, black_hole], timeout=TIMEOUT_S,
                          shard_deadline_s=DEADLINE_S)
    try:
        with pytest.raises(errors.UnavailableError, match=f"server {black_hole}.*per-shard deadline"):
            _returns(client.info)
    finally:
        client.close()


CONFIG = """
[server]
shard = {shard}

[[tables]]
name = "u"
capacity = 100
sampler = "uniform"
"""


def test_a_shard_that_hangs_after_joining_is_down_until_a_background_probe_finds_it(tmp_path):
    servers = [start_server(tmp_path, CONFIG.format(shard=s), name=f"s{s}") for s in (0, 1)]
    addresses = [s.address for s in servers]
    lenient = ReplayClient(addresses, allow_degraded=True, timeout=TIMEOUT_S,
                           shard_deadline_s=DEADLINE_S)
    strict = ReplayClient(addresses, timeout=TIMEOUT_S, shard_deadline_s=DEADLINE_S)
    stopped = False
    try:
        for shard, server in enumerate(servers):
            with ReplayClient(server.address) as direct:
                direct.insert("u", {"x": torch.full((5,), float(shard))})
        assert lenient.sample("u", 8).missing_shards == ()
        assert strict.info()["u"].size == 10
        servers[1].process.send_signal(signal.SIGSTOP)  # shard 1 hangs: connected, silent
        stopped = True

        with pytest.raises(errors.UnavailableError, match=r"shard 1 \(127\.0\.0\.1:\d+\) did not "
                                                          r"answer within the per-shard deadline"):
            _returns(lambda: strict.sample("u", 8))
        batch = _returns(lambda: lenient.sample("u", 8))
        assert batch.missing_shards == (1,) and set((batch.ids >> 56).tolist()) == {0}
        ids = torch.cat([_returns(lambda: lenient.insert("u", {"x": torch.zeros(2)}))
                         for _ in range(4)])
        assert set((ids >> 56).tolist()) == {0}  # inserts go to the live shard
        assert _returns(lenient.info)["u"].size == 13
        assert 1 in lenient.shard_stats().down

        servers[1].process.send_signal(signal.SIGCONT)
        stopped = False
        assert wait_for(lambda: 1 not in lenient.shard_stats().down, timeout=30)
        assert lenient.shard_stats().rejoins >= 1  # found by the background probe
        assert lenient.info()["u"].size == 18
    finally:
        if stopped:
            servers[1].process.send_signal(signal.SIGCONT)
        lenient.close()
        strict.close()
        for server in servers:
            server.stop()


# ------------------------------------------------------------------ hostile masses

GOOD = SamplingMass(4.0, 1.0, 4)
BAD = [SamplingMass(math.nan, 1.0, 4), SamplingMass(math.inf, 1.0, 4),
       SamplingMass(-1.0, 1.0, 4), SamplingMass(4.0, math.nan, 4), SamplingMass(4.0, 0.0, 4),
       SamplingMass(4.0, 1.0, -1)]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_shard_mass_no_table_can_have_is_refused_naming_the_shard(bad):
    masses = {0: GOOD, 3: bad}
    rng = np.random.default_rng(0)
    with pytest.raises(errors.ShardingError, match="shard 3 reported a sampling mass"):
        split(16, masses, rng)
    with pytest.raises(errors.ShardingError, match="shard 3"):
        shares(masses)
    with pytest.raises(errors.ShardingError, match="shard 3"):
        MassBook().put("u", 3, bad)
    part = SampleBatch({"x": torch.zeros(2)}, torch.arange(2), torch.ones(2),
                       torch.full((2,), 0.25, dtype=torch.float64))
    out = [torch.empty(2), torch.empty(2, dtype=torch.int64), torch.empty(2),
           torch.empty(2, dtype=torch.float64)]
    with pytest.raises(errors.ShardingError, match="shard 3"):
        merge_into(out, ["x"], {0: [part]}, {0: 1.0, 3: 0.0}, masses, 0.4, rng)


def test_good_masses_still_split_and_merge():
    assert sum(split(16, {0: GOOD, 1: SamplingMass(0.0, math.inf, 0)},
                     np.random.default_rng(0)).values()) == 16


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "2"])
def test_a_bad_per_shard_deadline_is_refused_before_connecting(bad):
    with pytest.raises(errors.InvalidArgumentError, match="shard_deadline_s must be"):
        ReplayClient(["127.0.0.1:1", "127.0.0.1:2"], shard_deadline_s=bad)
    with pytest.raises(errors.InvalidArgumentError, match="apply to a sharded client"):
        ReplayClient("127.0.0.1:1", shard_deadline_s=1.0)


# ------------------------------------------------------------------ slow is not down


def test_a_slow_shard_that_answers_its_probe_is_waited_for_not_counted_down(shard0):
    """A strict client's fetch waits on shard 0 for a newer version for longer than the
    per-shard deadline: the probe answers, so the call is waited for and returns the version."""
    other = EmbeddedServer(settings_from_dict({
        "server": {"address": "127.0.0.1:0", "shard": 1, "shared_memory": False},
        "tables": [{"name": "u", "capacity": 100, "sampler": "uniform"}]}))
    client = ReplayClient([shard0.address, other.address], timeout=TIMEOUT_S,
                          shard_deadline_s=DEADLINE_S)
    try:
        assert client.publish("policy", {"w": torch.zeros(2)}) == 1
        got: list[Any] = []
        waiting = threading.Thread(
            target=lambda: got.append(client.fetch("policy", newer_than=1, timeout=TIMEOUT_S)))
        waiting.start()
        threading.Event().wait(4 * DEADLINE_S)  # past the deadline and the probe's
        with ReplayClient(shard0.address) as direct:
            direct.publish("policy", {"w": torch.ones(2)})
        waiting.join(BOUND_S)
        assert got and got[0].version == 2
        assert client.shard_stats().down == {}
    finally:
        client.close()
        other.close()


def test_settle_waits_for_a_late_call_whose_shard_answers_its_probe_and_drops_a_silent_one():
    from concurrent.futures import Future

    from replay_client.sharded.deadline import settle

    calls = {s: Future() for s in (0, 1, 2)}
    calls[0].set_result("fast")
    probed = {s: threading.Event() for s in (1, 2)}

    def probe(shard: int) -> Future:
        answer: Future = Future()
        if shard == 1:  # alive: answers the probe, finishes its call afterwards
            answer.set_exception(errors.OverloadedError("busy"))  # an answer all the same
            threading.Thread(target=lambda: calls[1].set_result("slow")).start()
        else:  # silent
            answer.set_exception(errors.DeadlineExceededError("no answer"))
        probed[shard].set()
        return answer

    outcomes = settle(calls, 0.05, probe, lambda s: f"shard {s} (here)")
    assert outcomes[0] == "fast" and outcomes[1] == "slow"
    assert isinstance(outcomes[2], errors.UnavailableError)
    assert "shard 2 (here) did not answer within the per-shard deadline" in str(outcomes[2])
