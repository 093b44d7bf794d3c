"""A sharded replay on a real two-node Ray cluster (loopback): placed, fed, sampled, killed,
restarted, stopped.

One cluster for the package (``conftest.ray_cluster``, started once: about ten
seconds), one checkpointed replay of two shards for most tests (``replay``: its
shards start once) and one worker actor for the writers and learners that run
beside a fault or a scale (``worker``; they are in ``workers.py``), in the order
the tests need them: the fault tests take ``replay`` through a crash and a lost
node, and the last test shuts it down.

Faults:

* A shard killed under a streaming learner and a writer (both degraded): the
  learner goes on over shard 0 (its batches list shard 1 in
  ``missing_shards``), the writer's rows go to shard 0, no error reaches
  either; Ray restarts shard 1, which restores its checkpoint (exactly the
  rows it held then) and registers again; both take it back. Counts are
  checked from the ids (bits 40..55: the id incarnation, new after a restart).
* A shard with the write-ahead log on (a replay of its own), killed: it restarts,
  replays its log from the directory every node reads and rejoins with every
  acknowledged row, those after its last checkpoint too (issue 29).
* Its node lost: Ray cannot place it again, so the registry says
  ``restarting`` for as long as the test wants; a client made then knows
  (strict: refused naming shard 1; degraded: ``missing_shards``). A new node
  with the resource brings it back, restored.

Scale: a replay of its own (``grown``: one shard) goes to two under a writer
and a learner, then to three and back to two (rows moved, clients and a stream
made before drop the removed shard), and stops.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import wait_for
from tests.server.ray.conftest import NODE_A, NODE_B, SKIP_REASON, add_node_b, loopback_addresses
from tests.server.ray.workers import Worker, learn, write

ray = pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)

from replay_client.errors import UnavailableError  # noqa: E402
from replay_server.app.config_file import settings_from_dict  # noqa: E402
from replay_server.app.embedded import EmbeddedServer  # noqa: E402
from replay_server.errors import ConfigError  # noqa: E402
from replay_server.ray import ReplayCluster, ReplayExistsError, ReplayNotFoundError  # noqa: E402

ALPHA = 0.6
TABLES = [{"name": "p", "capacity": 4000, "sampler": "prioritized", "alpha": ALPHA, "beta": 0.4},
          # the writer's 3000 inserts of 8 rows fit one shard: no row of "u" ages out
          {"name": "u", "capacity": 40_000, "sampler": "uniform"},
          {"name": "q", "capacity": 100, "sampler": "fifo"}]  # rows leave it: never scaled down
ON_BOTH = [{"num_cpus": 0, "resources": NODE_A}, {"num_cpus": 0, "resources": NODE_B}]
INCARNATION = lambda ids: (np.asarray(ids) >> 40) & 0xFFFF  # noqa: E731 (id bits 40..55)


def start(name: str, tmp_path: Path | None = None, **options) -> ReplayCluster:
    return ReplayCluster.create(name, tables=TABLES, num_shards=2, shard_options=ON_BOTH,
                                checkpoint_dir=None if tmp_path is None else str(tmp_path),
                                checkpoint_interval_s=0, get_if_exists=False,
                                registry_options={"resources": NODE_A}, **options)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def replay(ray_cluster, checkpoints):
    replay = start("shared", checkpoints)
    yield replay
    replay.shutdown()  # idempotent: the last test has shut it down


def test_shards_spread_over_both_nodes_on_loopback_with_their_metrics(replay) -> None:
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
        assert sorted(client.info()) == ["p", "q", "u"]
    assert ReplayCluster.get("shared").states() == states


def test_writers_on_both_nodes_and_a_streaming_learner_sample_the_whole_replay_exactly(
        replay) -> None:
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


def test_a_restarted_registry_learns_the_shards_back_from_them(replay) -> None:
    before, where = replay.states(), replay.registry()
    assert ray.get_actor("shared", namespace="replay") is not None
    ray.kill(ray.get_actor("shared", namespace="replay"), no_restart=False)  # entries lost
    assert wait_for(lambda: replay.registry()["pid"] != where["pid"], timeout=60)
    assert wait_for(lambda: replay.states() == before, timeout=60)  # told by the shards
    with replay.client(wait_for_shards_s=30) as client:  # made while it may still learn
        assert sorted(client.shards) == [0, 1]
        client.insert("u", {"key": torch.arange(8)})
        assert client.sample("u", 4).missing_shards == ()


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
        with pytest.raises(ReplayExistsError, match=r"table 'u': capacity 100 running, 200 "
                           r"asked; table 'u': sampler 'uniform' running, 'prioritized' asked"):
            ReplayCluster.create("orphan", tables=[{"name": "u", "capacity": 200,
                                                    "sampler": "prioritized"}], num_shards=2)
        with pytest.raises(ReplayExistsError, match="table 'v' is not running"):
            ReplayCluster.create("orphan", tables=[{"name": "u", "capacity": 100},
                                                   {"name": "v", "capacity": 10}], num_shards=2)
        with replay.client() as client:
            assert client.info()["u"].size == 10  # a refused create changed nothing
    finally:
        replay.shutdown()


def test_a_bad_table_is_refused_before_any_actor_starts(ray_cluster) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        ReplayCluster.create("bad", tables=[{"name": "u"}], num_shards=1)
    with pytest.raises(ConfigError, match="num_shards"):
        ReplayCluster.create("bad", tables=TABLES, num_shards=0)
    with pytest.raises(UnavailableError, match="no replay 'bad'"):
        ReplayCluster("bad", "replay", None, 1).client().info()


# ------------------------------------------------------------------ faults


def _filled(replay: ReplayCluster) -> tuple[dict[int, int], dict[int, int]]:
    """200 rows, then a checkpoint: each shard's size and id incarnation in it."""
    with replay.client() as client:
        ids = torch.cat([client.insert("u", {"key": torch.arange(k, k + 20)})
                         for k in range(0, 200, 20)]).numpy()
        replay.checkpoint()
        sizes = {s: info.tables["u"].size for s, info in client.shard_info().items()}
    return sizes, {s: int(INCARNATION(ids[(ids >> 56) == s]).max()) for s in (0, 1)}



@pytest.fixture(scope="module")
def worker(ray_cluster):
    """The module's writer and learner (one actor: one process start for every test)."""
    worker = Worker.options(resources=NODE_A, max_concurrency=4).remote()
    yield worker
    ray.kill(worker)


@pytest.fixture()
def running(worker):
    """``worker``, reset for this test and stopped after it, whatever happened."""
    ray.get(worker.reset.remote())
    yield worker
    ray.get(worker.stop.remote())


def test_a_killed_shard_restarts_restores_and_rejoins_a_learner_and_a_writer(
        replay, running) -> None:
    sizes, incarnations = _filled(replay)
    before = replay.states()[1]
    client = replay.client(allow_degraded=True)
    written, learned = running.write.remote(client), running.learn.remote(client)
    with replay.client() as strict:
        assert wait_for(lambda: sum(i.tables["u"].size for i in strict.shard_info().values())
                        > 400, timeout=60)
    ray.kill(replay.shards[1], no_restart=False)  # a crash: no drain, no final checkpoint
    assert wait_for(lambda: replay.states()[1]["incarnation"] == before["incarnation"] + 1
                    and replay.states()[1]["state"] == "serving", timeout=60)
    after = replay.states()[1]
    assert after["pid"] != before["pid"]  # a new process (its port is chosen anew)
    assert after["address"].startswith("127.0.0.1:")
    with replay.client() as strict:  # the writer's rows reach the restarted shard again
        assert wait_for(lambda: strict.shard_info()[1].tables["u"].size > sizes[1], timeout=60)
    assert wait_for(lambda: ray.get(running.rejoined.remote()), timeout=60)  # so does the stream
    ray.get(running.stop.remote())
    ids, seen = np.array(ray.get(written, timeout=120)), ray.get(learned, timeout=120)

    on0, on1 = ids[(ids >> 56) == 0], ids[(ids >> 56) == 1]
    reborn = on1[INCARNATION(on1) > incarnations[1]]  # written to shard 1 after its restart
    assert len(reborn) > 0
    with replay.client() as strict:
        now = {s: info.tables["u"].size for s, info in strict.shard_info().items()}
    assert now[0] == sizes[0] + len(on0)  # nothing lost, nothing doubled on shard 0
    assert now[1] == sizes[1] + len(reborn)  # the checkpoint, and what came after the restart
    missing = [i for i, (gone, _) in enumerate(seen) if gone == (1,)]
    assert missing, "the learner never saw shard 1 missing"
    assert all(shards == [0] for gone, shards in seen if gone == (1,))
    assert any(gone == () and 1 in shards for gone, shards in seen[missing[-1]:])  # rejoined


def test_a_killed_logged_shard_rejoins_with_every_acknowledged_row(ray_cluster,
                                                                   tmp_path) -> None:
    replay = start("logged", tmp_path, server={"wal": True, "wal_sync": "os"})
    try:
        with replay.client() as client:
            ids = [client.insert("u", {"key": torch.arange(k, k + 20)}).numpy()
                   for k in range(0, 200, 20)]
            replay.checkpoint()
            ids += [client.insert("u", {"key": torch.arange(k, k + 20)}).numpy()
                    for k in range(200, 400, 20)]  # acknowledged, in no checkpoint
        stored = np.concatenate(ids)
        on1 = stored[(stored >> 56) == 1]
        assert 0 < len(on1) < len(stored)
        before = replay.states()[1]
        ray.kill(replay.shards[1], no_restart=False)  # a crash: no drain, no final checkpoint
        assert wait_for(lambda: replay.states()[1]["incarnation"] > before["incarnation"]
                        and replay.states()[1]["state"] == "serving", timeout=90)
        with replay.client() as client:
            sizes = {s: info.tables["u"].size for s, info in client.shard_info().items()}
            assert sizes[1] == len(on1) and sum(sizes.values()) == len(stored)
            read = client.read("u", ids=stored)
            assert read.columns["key"].tolist() == list(range(400))  # each row by its id
    finally:
        replay.shutdown()


def test_a_client_made_while_a_shard_cannot_restart_knows_it_is_missing(
        ray_cluster, replay) -> None:
    sizes, _ = _filled(replay)
    incarnation = replay.states()[1]["incarnation"]
    node_b = next(n for n in ray_cluster.worker_nodes if n.node_id == replay.states()[1][
        "node_id"])
    ray_cluster.remove_node(node_b)  # shard 1's node is lost: nowhere to restart it
    try:
        assert wait_for(lambda: replay.states()[1]["state"] == "restarting", timeout=60)
        strict = replay.client(wait_for_shards_s=0.5)
        with pytest.raises(UnavailableError, match=rf"shard 1 is restarting \(incarnation "
                                                   rf"{incarnation}"):
            strict.sample("u", 8)
        with replay.client(allow_degraded=True) as degraded:
            batch = degraded.sample("u", 8)
            assert batch.missing_shards == (1,)
            assert set((batch.ids >> 56).tolist()) == {0}
            assert "restarting" in degraded.shard_stats().down[1]
    finally:
        add_node_b(ray_cluster)  # a node with the resource: shard 1 restarts there
    assert loopback_addresses() == {"127.0.0.1"}
    assert wait_for(lambda: replay.states()[1]["state"] == "serving", timeout=90)
    assert replay.states()[1]["incarnation"] == incarnation + 1
    assert sorted(strict.shards) == [0, 1]  # the strict client takes the whole replay now
    assert {s: i.tables["u"].size for s, i in strict.shard_info().items()} == sizes
    strict.close()


# ------------------------------------------------------------------ scale


GROWN = [{"name": "u", "capacity": 20_000, "sampler": "uniform"},  # no row ages out here
         {"name": "p", "capacity": 4000, "sampler": "prioritized", "alpha": ALPHA},
         {"name": "s", "capacity": 4000, "sampler": "slice", "slice_len": 4}]
EPISODES, STEPS = 30, 10  # the rows of 'p' and 's' that a scale down moves


def _names_left(name: str, shards: int) -> list[str]:
    names = [name, *(f"{name}.shard-{i}" for i in range(shards))]
    left = []
    for n in names:
        try:
            ray.get_actor(n, namespace="replay")
            left.append(n)
        except ValueError:
            pass
    return left


@pytest.fixture(scope="module")
def grown(ray_cluster, tmp_path_factory):
    """Replay ``grow``: one checkpointed shard on the head node, which the scale tests take
    up and then down in turn (one replay for both: its shards start once), and a handle made
    before any scale (it says 1 shard), which stops it: the registry knows every shard."""
    folder = tmp_path_factory.mktemp("grow")
    replay = ReplayCluster.create("grow", tables=GROWN, num_shards=1, checkpoint_dir=str(folder),
                                  shard_options={"num_cpus": 0, "resources": NODE_A},
                                  checkpoint_interval_s=0, get_if_exists=False,
                                  registry_options={"resources": NODE_A})
    stale = ReplayCluster.get("grow")
    yield replay, stale, folder
    stale.shutdown()  # idempotent: the scale-down test has shut it down


def test_scale_up_under_a_writer_and_a_learner_adds_a_shard_that_they_take_in(
        grown, running) -> None:
    """1 -> 2 shards while a writer (strict client) and a learner (degraded client), both
    made before, run: the new shard is expected only once it serves (the learner never
    sees a missing shard), both take it in at their next resolution (1 s here), and every
    acknowledged row is stored once on the shard its id names. (That the scaled count
    outlives a registry restart and a second create: the scale-down test, on this replay.)"""
    replay, _, _ = grown
    strict = replay.client(resolve_interval_s=1)
    degraded = replay.client(allow_degraded=True, resolve_interval_s=1)
    try:
        written, learned = running.write.remote(strict, 2000), running.learn.remote(degraded)
        with replay.client() as looker:
            assert wait_for(lambda: looker.info()["u"].size > 100, timeout=60)
        replay.scale(2, shard_options={"num_cpus": 0, "resources": NODE_B})
        assert replay.num_shards == 2 and ReplayCluster.get("grow").num_shards == 2
        states = replay.states()
        assert [(s["index"], s["state"]) for s in states] == [(0, "serving"), (1, "serving")]
        assert len({s["node_id"] for s in states}) == 2  # the new one where its options say
        assert wait_for(lambda: sorted(strict.shards) == [0, 1], timeout=30)  # resolved again
        with replay.client() as looker:  # the writer's rows reach the new shard
            assert wait_for(lambda: looker.shard_info()[1].tables["u"].size > 0, timeout=30)
        assert wait_for(lambda: any(1 in shards for _, shards in ray.get(
            running.seen_now.remote())), timeout=30)  # and the stream draws from it
    finally:
        ray.get(running.stop.remote())
    ids, seen = np.array(ray.get(written, timeout=120)), ray.get(learned, timeout=120)
    try:
        assert len(set(ids.tolist())) == len(ids)  # each shard index has its own id space
        on = {s: int(((ids >> 56) == s).sum()) for s in (0, 1)}
        assert on[1] > 0
        with replay.client() as after:  # every acknowledged row stored, once, where its id says
            assert {s: i.tables["u"].size for s, i in after.shard_info().items()} == on
            assert set((after.sample("u", 512).ids >> 56).tolist()) == {0, 1}
        assert all(gone == () for gone, _ in seen), "a shard was missing for the learner"
        assert strict.info()["u"].size == len(ids)
    finally:
        strict.close()
        degraded.close()


def _fill(client) -> dict[int, float]:
    """300 rows in each table, 30 episodes of 10 steps (key = episode * 10 + step); 'p' rows
    get priority 1 + key % 7, then half of them another by update: the priorities, by key."""
    for episode in range(EPISODES):
        keys = torch.arange(episode * STEPS, (episode + 1) * STEPS, dtype=torch.int64)
        rows = {"key": keys, "episode": torch.full((STEPS,), episode, dtype=torch.int64),
                "done": keys % STEPS == STEPS - 1}
        client.insert("p", rows, priorities=1.0 + (keys % 7).double())
        client.insert("s", rows)
    priority = {k: 1.0 + k % 7 for k in range(EPISODES * STEPS)}
    batch = client.sample("p", 64)
    new = 0.25 + (batch.columns["key"] % 3).double()
    client.update_priorities("p", batch.ids, new)
    priority.update(zip(batch.columns["key"].tolist(), new.tolist()))
    return priority


def _exact(client, priority: dict[int, float]) -> bool:
    """A draw of 'p' from every row: probabilities p^alpha / sum over all 300 rows."""
    batch = client.sample("p", 256)
    total = sum(p ** ALPHA for p in priority.values())
    want = np.array([priority[k] ** ALPHA / total for k in batch.columns["key"].tolist()])
    return batch.missing_shards == () and np.allclose(batch.probabilities.numpy(), want,
                                                      rtol=1e-5)


def test_scale_down_moves_the_removed_shard_rows_and_clients_drop_it(grown) -> None:
    """The grown replay, at 3 shards (two on the head node, one on the second), holds a
    prioritized and a slice table; clients and a learner's stream made before ``scale(2)``
    go on after it. It drains shard 2, moves its rows with their priorities to shards 0
    and 1 (each episode to one of them, in order), and the registry then expects two
    shards: the clients and the stream drop shard 2 at their next resolution and draw
    exactly over every row again, a late update naming one of shard 2's ids is skipped and
    counted, a registry that Ray restarts keeps the lowered count (and learns back shard 1,
    which a scale added), the create it was made with returns it unshrunk, and a shard 2
    started by a later scale up begins empty (its checkpoint folder was set aside).
    (A replay with a queue is refused a scale down: below, on ``replay``.)"""
    replay, stale, folder = grown
    replay.scale(3, shard_options={"num_cpus": 0, "resources": NODE_A})
    strict = replay.client(resolve_interval_s=1)
    degraded = replay.client(allow_degraded=True, resolve_interval_s=1)
    try:
        priority = _fill(strict)
        sizes = {s: i.tables["p"].size for s, i in strict.shard_info().items()}
        assert sorted(sizes) == [0, 1, 2] and sizes[2] > 0
        old_ids = strict.sample("p", 64).ids
        on_2 = old_ids[(old_ids >> 56) == 2]
        assert len(on_2) > 0
        stream = degraded.stream("p", 32)
        next(stream)
        with pytest.raises(ConfigError, match="shard_options has nothing to apply to"):
            replay.scale(2, shard_options={"num_cpus": 0})

        handed = replay.scale(2)

        assert handed[2]["moved"] == {"u": 0, "p": sizes[2], "s": sizes[2]}
        assert replay.num_shards == 2 and [s["index"] for s in replay.states()] == [0, 1]
        assert ReplayCluster.get("grow").num_shards == 2
        with pytest.raises(ValueError):
            ray.get_actor("grow.shard-2", namespace="replay")
        # set aside; only the id counter stays, so a later shard 2 begins empty, with new ids
        assert [p.name for p in (folder / "grow" / "shard-2").iterdir()] == ["INCARNATION"]
        assert Path(handed[2]["retired_checkpoints"]).is_dir()
        for client in (strict, degraded):  # made before: shard 2 dropped at their next resolve
            assert wait_for(lambda: sorted(client.shards) == [0, 1], timeout=30)
            info = client.info()
            assert info["p"].size == info["s"].size == EPISODES * STEPS  # none lost or doubled
            assert _exact(client, priority)
        assert degraded.shard_stats().down == {}  # retired, not down
        slices = strict.sample("s", 64).columns
        keys, episodes = slices["key"], slices["episode"]
        assert (keys[:, 1:] - keys[:, :-1] == 1).all()  # each slice: consecutive steps...
        assert (episodes == episodes[:, :1]).all()  # ...of one episode, wherever it went
        assert strict.update_priorities("p", on_2, torch.full((len(on_2),), 5.0)) == 0
        assert strict.shard_stats().skipped_updates == len(on_2)  # stale: skipped, counted

        # The stream drops shard 2 too: first from its batches, then from missing_shards once
        # its client's next resolve (resolve_interval_s = 1) says shard 2 was retired, not
        # down. Bounded in time, not in batches: on a loaded machine 200 batches came in
        # less than that resolve (missing_shards still (2,)).
        seen, deadline = [], time.monotonic() + 30
        for _, batch in zip(range(100_000), stream):
            seen.append(set((batch.ids >> 56).tolist()))
            if (len(seen) > 3 and not any(2 in s for s in seen[-3:])
                    and batch.missing_shards == ()) or time.monotonic() > deadline:
                break
        assert not any(2 in s for s in seen[-3:]), seen[-5:]
        assert batch.missing_shards == ()
        stream.close()

        where = replay.registry()  # a registry Ray restarts keeps the lowered count...
        ray.kill(ray.get_actor("grow", namespace="replay"), no_restart=False)
        assert wait_for(lambda: replay.registry()["pid"] != where["pid"], timeout=60)
        assert wait_for(lambda: [(s["index"], s["state"]) for s in replay.states()] == [
            (0, "serving"), (1, "serving")], timeout=60), replay.states()  # ...and shard 1
        assert ReplayCluster.get("grow").num_shards == 2
        again = ReplayCluster.create("grow", tables=GROWN, num_shards=1, checkpoint_interval_s=0,
                                     shard_options={"num_cpus": 0, "resources": NODE_A})
        assert again.num_shards == 2  # the same create after a scale: never rescaled
        with pytest.raises(ReplayExistsError, match=r"2 shards \(created with 1, then "
                                                    r"scaled\), not 3"):
            ReplayCluster.create("grow", tables=GROWN, num_shards=3)

        replay.scale(3, shard_options={"num_cpus": 0, "resources": NODE_B})
        with replay.client() as again:  # a new shard 2 starts empty: no row comes back twice
            assert {s: i.tables["p"].size for s, i in again.shard_info().items()}[2] == 0
            assert again.info()["p"].size == EPISODES * STEPS
        assert loopback_addresses() == {"127.0.0.1"}
    finally:
        strict.close()
        degraded.close()
        stale.shutdown()  # its handle says 1 shard: the registry's 3 are stopped
    assert _names_left("grow", 4) == []


def test_a_replay_with_a_queue_is_not_scaled_down_and_nothing_changes(replay) -> None:
    from replay_server.ray import ScaleDownError

    with replay.client() as client:
        client.insert("q", {"key": torch.arange(10)})
        held = client.info()["q"].size
    before = replay.states()
    with pytest.raises(ScaleDownError, match=r"cannot move the rows of \['q'\]: rows leave "
                                             r"those tables when sampled"):
        replay.scale(1)
    assert replay.states() == before and replay.num_shards == 2
    with replay.client() as client:
        assert client.info()["q"].size == held


def test_bad_scales_are_refused_naming_why_and_change_nothing(replay) -> None:
    before = replay.states()
    for bad in (0, 129, "3", 2.0, True, None):
        with pytest.raises(ConfigError, match=rf"num_shards must be an integer in 1\.\.128, "
                                              rf"got {re.escape(repr(bad))}"):
            replay.scale(bad)
    with pytest.raises(ConfigError, match=r"scale\(1\) removes shards: shard_options has "
                                          r"nothing to apply to"):
        replay.scale(1, shard_options={"num_cpus": 0})  # a scale down: on ``grown``, above
    with pytest.raises(ConfigError, match="shard_options is a list of 2 dicts for 1 shards"):
        replay.scale(3, shard_options=ON_BOTH)
    replay.scale(2)  # the count now: nothing to do
    assert replay.states() == before and _names_left("shared", 3) == [
        "shared", "shared.shard-0", "shared.shard-1"]


# ------------------------------------------------------------------ shutdown (last)


def _shm_of(pids: list[int]) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob("replay-*")
            if int(p.name.split("-")[1]) in pids]


def test_shutdown_checkpoints_then_leaves_no_actor_name_process_or_segment(
        replay, checkpoints) -> None:
    client = replay.client()
    client.insert("u", {"key": torch.arange(50, dtype=torch.int64)})
    sizes = {s: info.tables["u"].size for s, info in client.shard_info().items()}
    stream = client.stream("u", 8, shared_memory=True)  # rings in /dev/shm, one per shard
    next(stream)
    pids = [s["pid"] for s in replay.states()]
    stream.close()
    client.close()
    replay.shutdown()
    for name in ("shared", "shared.shard-0", "shared.shard-1"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="replay")
    assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=30), pids
    assert _shm_of(pids) == []
    with pytest.raises(ReplayNotFoundError, match="shared"):
        ReplayCluster.get("shared")
    for shard, size in sizes.items():  # the drain's final checkpoints hold every row
        server = EmbeddedServer(settings_from_dict({"server": {
            "address": "127.0.0.1:0", "shard": shard, "shared_memory": False,
            "checkpoint_dir": str(checkpoints / "shared" / f"shard-{shard}")},
            "tables": TABLES}))
        try:
            assert server.tables["u"].size == size
        finally:
            server.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
