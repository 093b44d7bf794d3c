"""A sharded replay on a real two-node Ray cluster (loopback): placed, fed, sampled, stopped.

One cluster for the module (``conftest.ray_cluster``); each test starts its
own replay under its own name and shuts it down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import wait_for
from tests.server.ray.conftest import NODE_A, NODE_B, loopback_addresses, ray

from replay_client.errors import UnavailableError  # noqa: E402
from replay_server.ray import ReplayCluster, ReplayExistsError, ReplayNotFoundError  # noqa: E402

ALPHA = 0.6
TABLES = [{"name": "p", "capacity": 4000, "sampler": "prioritized", "alpha": ALPHA, "beta": 0.4},
          {"name": "u", "capacity": 4000, "sampler": "uniform"}]
ON_BOTH = [{"num_cpus": 0, "resources": NODE_A}, {"num_cpus": 0, "resources": NODE_B}]


def start(name: str, tmp_path: Path | None = None, **options) -> ReplayCluster:
    return ReplayCluster.create(name, tables=TABLES, num_shards=2, shard_options=ON_BOTH,
                                checkpoint_dir=None if tmp_path is None else str(tmp_path),
                                checkpoint_interval_s=0, get_if_exists=False, **options)


@ray.remote(num_cpus=0.5)
def write(client, table: str, first: int, rows: int) -> list[int]:
    """Rows ``first .. first+rows-1`` (key, priority 1 + key % 7) in inserts of 16: their ids."""
    ids = []
    for start in range(first, first + rows, 16):
        keys = torch.arange(start, min(start + 16, first + rows), dtype=torch.int64)
        ids += client.insert(table, {"key": keys}, priorities=1.0 + (keys % 7).double()).tolist()
    return ids


@ray.remote(num_cpus=0.5)
def learn(client, table: str, batches: int) -> dict[int, float]:
    """A learner: streams ``batches`` batches, updating each row's priority to 0.5 + key % 5
    on the stream; the priorities it set, by id."""
    set_to = {}
    stream = client.stream(table, 32, num_batches=batches)
    for batch in stream:
        new = 0.5 + (batch.data["key"] % 5).double()
        stream.update_priorities(batch.ids, new)
        set_to.update(zip(batch.ids.tolist(), new.tolist()))
    stream.close()
    return set_to


def test_shards_spread_over_both_nodes_on_loopback_with_their_metrics(ray_cluster) -> None:
    replay = start("spread")
    try:
        states = replay.states()
        assert [s["state"] for s in states] == ["serving", "serving"]
        assert [s["incarnation"] for s in states] == [1, 1]
        assert len({s["node_id"] for s in states}) == 2  # one per node
        for s in states:
            host, port = s["address"].rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            metrics_host, metrics_port = s["metrics_address"].rsplit(":", 1)
            assert metrics_host == "127.0.0.1" and int(metrics_port) > 0
            with urllib.request.urlopen(f"http://{s['metrics_address']}/metrics", timeout=10) as r:
                assert b"replay_" in r.read()
        assert loopback_addresses() == {"127.0.0.1"}
        with replay.client() as client:
            assert client.shards == {s["index"]: s["address"] for s in states}
            assert sorted(client.info()) == ["p", "u"]
        assert ReplayCluster.get("spread").states() == states
    finally:
        replay.shutdown()


def test_writers_on_both_nodes_and_a_streaming_learner_sample_the_whole_replay_exactly(
        ray_cluster) -> None:
    replay = start("fed")
    try:
        client = replay.client(seed=3)
        a = write.options(resources=NODE_A).remote(client, "p", 0, 300)
        b = write.options(resources=NODE_B).remote(client, "p", 300, 300)
        ids = ray.get(a) + ray.get(b)
        assert len(set(ids)) == 600
        assert set(np.array(ids) >> 56) == {0, 1}  # both nodes' rows on both shards
        info = client.shard_info()
        assert info[0].tables["p"].size + info[1].tables["p"].size == 600 and min(
            info[0].tables["p"].size, info[1].tables["p"].size) > 0
        set_to = ray.get(learn.options(resources=NODE_B).remote(client, "p", 12))
        assert set_to and set(np.array(list(set_to)) >> 56) == {0, 1}

        keys = {i: k for i, k in zip(ids, range(600))}  # ids in key order
        priority = {i: set_to.get(i, 1.0 + keys[i] % 7) for i in ids}
        masses = np.array([priority[i] for i in ids]) ** ALPHA

        def exact() -> bool:  # the learner's last updates ride on its last credit
            batch = client.sample("p", 256)
            want = np.array([priority[i] for i in batch.ids.tolist()]) ** ALPHA / masses.sum()
            return np.allclose(batch.probabilities.numpy(), want, rtol=1e-4)
        assert wait_for(exact, timeout=20)
        client.close()
    finally:
        replay.shutdown()


def _shm_of(pids: list[int]) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob("replay-*")
            if int(p.name.split("-")[1]) in pids]


def test_shutdown_checkpoints_then_leaves_no_actor_name_process_or_segment(
        ray_cluster, tmp_path) -> None:
    replay = start("stopped", tmp_path)
    client = replay.client()
    client.insert("u", {"key": torch.arange(50, dtype=torch.int64)})
    stream = client.stream("u", 8, shared_memory=True)  # rings in /dev/shm, one per shard
    next(stream)
    pids = [s["pid"] for s in replay.states()]
    stream.close()
    client.close()
    replay.shutdown()
    for name in ("stopped", "stopped.shard-0", "stopped.shard-1"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="replay")
    assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=30), pids
    assert _shm_of(pids) == []
    with pytest.raises(ReplayNotFoundError, match="stopped"):
        ReplayCluster.get("stopped")
    again = start("stopped", tmp_path)  # the drain's final checkpoints are restored
    try:
        with again.client() as client:
            assert client.info()["u"].size == 50
    finally:
        again.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


DRIVER = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import ray, torch
from replay_server.ray import ReplayCluster
ray.init(address=sys.argv[1], logging_level="warning", log_to_driver=False)
replay = ReplayCluster.create("orphan", tables=[{"name": "u", "capacity": 100,
                              "sampler": "uniform"}], num_shards=2,
                              shard_options={"num_cpus": 0}, checkpoint_interval_s=0)
replay.client().insert("u", {"key": torch.arange(10)})
os._exit(3)  # the driver fails: no shutdown, no ray.shutdown
"""


def test_get_or_create_after_a_failed_driver_returns_the_running_replay(ray_cluster) -> None:
    done = subprocess.run([sys.executable, "-c", DRIVER, ray_cluster.address], timeout=180,
                          capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 3, done.stderr[-3000:]
    replay = ReplayCluster.create("orphan", tables=[{"name": "u", "capacity": 100,
                                                     "sampler": "uniform"}], num_shards=2,
                                  shard_options={"num_cpus": 0}, get_if_exists=True)
    try:
        assert [s["incarnation"] for s in replay.states()] == [1, 1]  # the same shards
        with replay.client() as client:
            assert client.info()["u"].size == 10
        with pytest.raises(ReplayExistsError, match="get_if_exists"):
            ReplayCluster.create("orphan", tables=[{"name": "u", "capacity": 100}],
                                 num_shards=2, get_if_exists=False)
        with pytest.raises(ReplayExistsError, match="2 shards, not 3"):
            ReplayCluster.create("orphan", tables=[{"name": "u", "capacity": 100}],
                                 num_shards=3)
    finally:
        replay.shutdown()


def test_a_bad_table_is_refused_before_any_actor_starts(ray_cluster) -> None:
    from replay_server.errors import ConfigError

    with pytest.raises(ConfigError, match="capacity"):
        ReplayCluster.create("bad", tables=[{"name": "u"}], num_shards=1)
    with pytest.raises(ConfigError, match="num_shards"):
        ReplayCluster.create("bad", tables=TABLES, num_shards=0)
    with pytest.raises(UnavailableError, match="no replay 'bad'"):
        ReplayCluster("bad", "replay", None, 1).client().info()
