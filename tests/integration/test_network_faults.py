"""Learner streams across a slow or faulty network: real servers, the real client, and the test
proxy (``tests/tools/proxy.py``) between them on loopback.

* 5 ms each way: batches arrive whole and in order.
* A shard's link stalls for 6 s: in degraded mode the stream goes on without the shard and
  takes it back after; by default it waits for it and goes on, losing nothing.
* Connections reset in the middle of batches: the stream reconnects; no batch is lost, none
  is delivered twice, none is torn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import ServerProcess, start_server, wait_for
from tests.tools.proxy import LinkProxy

FRAME = (84, 84, 4)
STALL_S = 6.0
"""How long a shard's link stalls: the sharded stream leaves a shard out once it has sent no
rows for 2 s (``replay_client.sharded.stream.STALL_S``), so batches drawn from 3 s into the
stall to its end show what the stream does without the shard."""

CONFIG = """
[server]
shard = {shard}

[[tables]]
name = "frames"
capacity = 600
sampler = "prioritized"

[[tables]]
name = "rows"
capacity = 3000
sampler = "prioritized"

[[tables]]
name = "wide"
capacity = 3000
"""


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[list[ServerProcess]]:
    tmp = tmp_path_factory.mktemp("faults")
    procs = [start_server(tmp, CONFIG.format(shard=s), name=f"s{s}") for s in (0, 1, 2)]
    yield procs
    for proc in procs:
        proc.stop()


def fill_frames(client: ReplayClient, rows: int = 300) -> torch.Tensor:
    """Atari-like rows whose every pixel says which row it is; the ids insert returned."""
    client.reset("frames")
    index = torch.arange(rows)
    frames = (index % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(rows, *FRAME).clone()
    ids = [client.insert("frames", {"row": index[i:i + 100], "frame": frames[i:i + 100]})
           for i in range(0, rows, 100)]
    return torch.cat(ids)


def intact(batch, issued: torch.Tensor) -> bool:
    """Every row of the batch is the row its id names, whole (no torn or mixed chunk)."""
    rows = batch.data["row"]
    pixels = batch.data["frame"].reshape(len(rows), -1)
    return (torch.equal(issued[rows], batch.ids)
            and bool((pixels == (rows % 251).to(torch.uint8).view(-1, 1)).all()))


def test_a_stream_at_5_ms_each_way_delivers_whole_batches_in_order(servers) -> None:
    server = servers[0]
    issued = fill_frames(ReplayClient(server.address))
    with LinkProxy(server.address, delay_s=0.005) as proxy:
        client = ReplayClient(proxy.address)
        count = 0
        for batch in client.stream("frames", 64, num_batches=20, shared_memory=False):
            assert intact(batch, issued)
            count += 1
        assert count == 20 and proxy.stats.bytes_down > 20 * 64 * 84 * 84 * 4
        client.close()


def test_over_a_slow_link_the_window_widens_unless_the_learner_fixed_it(servers) -> None:
    server = servers[0]
    client = ReplayClient(server.address)
    client.insert("wide", {"x": torch.randn(3000, 64)})
    with LinkProxy(server.address, delay_s=0.02) as proxy:  # a 40 ms round trip
        remote = ReplayClient(proxy.address)
        with remote.stream("wide", 256, batches_per_message=1, shared_memory=False) as stream:
            for _ in range(60):  # the learner waits on every batch at first: wider
                next(stream)
            assert stream.window > 2, stream.stats.notes
        with remote.stream("wide", 256, prefetch=2, batches_per_message=1,
                           shared_memory=False) as fixed:
            for _ in range(20):
                next(fixed)
            assert fixed.window == 2  # the learner's own prefetch is kept
        remote.close()


def test_resets_in_the_middle_of_batches_lose_duplicate_and_tear_none(servers) -> None:
    server = servers[0]
    issued = fill_frames(ReplayClient(server.address))
    # 50 MB/s: a 7 MB batch (two 4 MiB chunks) is on the wire for about 140 ms, so resets
    # every 300 ms land inside batches.
    with LinkProxy(server.address, bandwidth=50e6) as proxy:
        client = ReplayClient(proxy.address, max_retry_s=30)
        stream = client.stream("frames", 256, num_batches=12, shared_memory=False)
        stop = threading.Event()

        def resets() -> None:
            for _ in range(4):
                if stop.wait(0.3):
                    return
                proxy.reset()

        resetter = threading.Thread(target=resets)
        resetter.start()
        seen = []
        try:
            for batch in stream:
                assert intact(batch, issued)
                seen.append(tuple(batch.ids.tolist()))
        finally:
            stop.set()
            resetter.join()
        assert len(seen) == 12  # none lost
        assert len(set(seen)) == 12  # none twice (256 draws of 300 rows never repeat by chance)
        assert proxy.stats.resets >= 1 and stream.stats.reconnects >= 1
        client.close()


@pytest.mark.parametrize("degraded", [True, False], ids=["degraded", "strict"])
def test_a_shard_link_stalled_for_seconds(servers, degraded) -> None:
    for proc in servers:
        one = ReplayClient(proc.address)
        one.reset("rows")
        one.insert("rows", {"x": torch.arange(300)}, priorities=torch.ones(300))
    with LinkProxy(servers[1].address) as proxy:
        addresses = [servers[0].address, proxy.address, servers[2].address]
        client = ReplayClient(addresses, allow_degraded=degraded, seed=3)
        stream = client.stream("rows", 32, prefetch=2, batches_per_message=1)
        batches: list[tuple[float, tuple[int, ...], set[int]]] = []
        failures: list[BaseException] = []
        stop = threading.Event()

        def learner() -> None:
            try:
                for batch in stream:
                    batches.append((time.monotonic(), batch.missing_shards,
                                    set((batch.ids >> 56).tolist())))
                    if stop.is_set():
                        return
                    time.sleep(0.01)
            except BaseException as exc:  # noqa: BLE001 - the test fails on it
                failures.append(exc)

        thread = threading.Thread(target=learner)
        thread.start()
        try:
            assert wait_for(lambda: len(batches) >= 20)
            proxy.stall()
            stalled_at = time.monotonic()
            time.sleep(STALL_S)
            during = [b for b in batches if stalled_at + 3 < b[0] < stalled_at + STALL_S]
            proxy.resume()
            resumed_at = time.monotonic()
            assert wait_for(lambda: any(t > resumed_at and 1 in shards
                                        for t, _, shards in batches), timeout=30)
        finally:
            stop.set()
            thread.join(30)
            stream.close()
            client.close()
        assert not failures, failures
        if degraded:  # went on without shard 1, said so, and took it back
            assert len(during) >= 10 and all(missing == (1,) and 1 not in shards
                                              for _, missing, shards in during)
            assert client.shard_stats().rejoins >= 1
        else:  # waited for shard 1: nothing drawn without it
            assert not during
            assert all(missing == () for _, missing, _ in batches)
