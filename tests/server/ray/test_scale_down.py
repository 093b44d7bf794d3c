"""A replay scaled down on a real two-node Ray cluster (loopback): no row leaves it.

Three shards (two on the head node, one on the second) hold a prioritized
table and a slice table; clients and a learner's stream made before the
scale go on after it. ``scale(2)`` drains shard 2, moves its rows with their
priorities to shards 0 and 1 (each episode to one of them, in order), and
the registry then expects two shards: the clients and the stream drop shard
2 at their next resolution and draw exactly over every row again, a late
update naming one of shard 2's ids is skipped and counted, a registry that
Ray restarts keeps the lowered count, and a shard 2 started by a later scale
up begins empty (its checkpoint folder was set aside). (A replay with a queue
is refused a scale down: test_replay_cluster.py, on its replay of two shards.)
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import wait_for
from tests.server.ray.conftest import NODE_A, NODE_B, SKIP_REASON, loopback_addresses

ray = pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)

from replay_server.errors import ConfigError  # noqa: E402
from replay_server.ray import ReplayCluster  # noqa: E402

ALPHA = 0.6
TABLES = [{"name": "p", "capacity": 4000, "sampler": "prioritized", "alpha": ALPHA},
          {"name": "s", "capacity": 4000, "sampler": "slice", "slice_len": 4}]
EPISODES, STEPS = 30, 10


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


def test_scale_down_moves_the_removed_shard_rows_and_clients_drop_it(
        ray_cluster, tmp_path: Path) -> None:
    replay = ReplayCluster.create(
        "shrink", tables=TABLES, num_shards=3, checkpoint_dir=str(tmp_path),
        checkpoint_interval_s=0, get_if_exists=False, registry_options={"resources": NODE_A},
        shard_options=[{"num_cpus": 0, "resources": r} for r in (NODE_A, NODE_B, NODE_A)])
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

        assert handed[2]["moved"] == {"p": sizes[2], "s": sizes[2]}
        assert replay.num_shards == 2 and [s["index"] for s in replay.states()] == [0, 1]
        assert ReplayCluster.get("shrink").num_shards == 2
        with pytest.raises(ValueError):
            ray.get_actor("shrink.shard-2", namespace="replay")
        assert not (tmp_path / "shrink" / "shard-2").exists()
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

        where = replay.registry()  # a registry Ray restarts keeps the lowered count
        ray.kill(ray.get_actor("shrink", namespace="replay"), no_restart=False)
        assert wait_for(lambda: replay.registry()["pid"] != where["pid"], timeout=60)
        assert wait_for(lambda: [(s["index"], s["state"]) for s in replay.states()] == [
            (0, "serving"), (1, "serving")], timeout=60), replay.states()
        assert ReplayCluster.get("shrink").num_shards == 2

        replay.scale(3, shard_options={"num_cpus": 0, "resources": NODE_B})
        with replay.client() as grown:  # a new shard 2 starts empty: no row comes back twice
            assert {s: i.tables["p"].size for s, i in grown.shard_info().items()}[2] == 0
            assert grown.info()["p"].size == EPISODES * STEPS
        assert loopback_addresses() == {"127.0.0.1"}
    finally:
        strict.close()
        degraded.close()
        replay.shutdown()

