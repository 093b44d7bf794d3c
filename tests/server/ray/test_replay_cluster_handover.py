"""A scale down whose hand-over a staying shard refuses part-way, on the package's real
two-node Ray cluster (loopback): the replay is left as it was (every row once, the shard
that was to go serving again, also after a restart), and the same scale asked again once
the cause is gone ends with every row exactly once. (The hand-over logic between embedded
servers, without Ray: ``test_handover.py``; scale downs that succeed:
``test_replay_cluster.py``.)

Three shards go to one. The deterministic cause: shard 0's table ``v`` was given another
schema first (``key`` float32), so it refuses shard 1's ``v`` rows after shard 1's ``p`` rows
have moved; shard 2 (no ``v`` rows) hands every row over, then serves again, empty, since the
scale failed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import wait_for
from tests.server.ray.conftest import NODE_A, NODE_B, SKIP_REASON, loopback_addresses

ray = pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)

from replay_client import ReplayClient  # noqa: E402
from replay_server.ray import ReplayCluster, ScaleDownError  # noqa: E402

TABLES = [{"name": "p", "capacity": 2000, "sampler": "prioritized", "alpha": 1.0},
          {"name": "v", "capacity": 2000, "sampler": "uniform"}]
P_KEYS, V_KEYS = list(range(200)), list(range(1000, 1050))


def _keys(replay: ReplayCluster, table: str) -> dict[int, list[int]]:
    """Each shard's int64 ``key`` column of ``table``, oldest first (every row read)."""
    found = {}
    for shard in replay.states():
        with ReplayClient(shard["address"]) as client:
            size = client.info()[table].size
            read = client.read(table, positions=np.arange(size)) if size else None
        found[shard["index"]] = ([] if read is None or read.columns["key"].dtype != torch.int64
                                 else read.columns["key"].tolist())
    return found


def _once(found: dict[int, list[int]]) -> list[int]:
    return sorted(k for keys in found.values() for k in keys)


@pytest.mark.parametrize("crash", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["retry", "crash-then-retry"])
def test_a_scale_down_refused_part_way_leaves_each_row_once_and_a_retry_finishes(
        ray_cluster, tmp_path, crash) -> None:
    """``crash``: shard 1 is also killed after the failed scale (its restart must bring no
    moved row back: the checkpoint it wrote when it served again); in ``make soak``, as a
    restart costs ~10 s here (test_handover.py restores that checkpoint without Ray)."""
    replay = ReplayCluster.create(
        "refused", tables=TABLES, num_shards=3, checkpoint_dir=str(tmp_path),
        checkpoint_interval_s=0, get_if_exists=False, registry_options={"resources": NODE_A},
        shard_options=[{"num_cpus": 0, "resources": NODE_A},
                       {"num_cpus": 0, "resources": NODE_B},
                       {"num_cpus": 0, "resources": NODE_A}])
    try:
        with replay.client() as client:  # inserts take turns: every shard holds 'p' rows
            for start in range(0, len(P_KEYS), 10):
                keys = torch.arange(start, start + 10)
                client.insert("p", {"key": keys}, priorities=1.0 + (keys % 7).double())
        first = {s["index"]: s for s in replay.states()}
        with ReplayClient(first[0]["address"]) as shard0:
            shard0.insert("v", {"key": torch.zeros(3, dtype=torch.float32)})
        with ReplayClient(first[1]["address"]) as shard1:
            shard1.insert("v", {"key": torch.tensor(V_KEYS)})
        before = _keys(replay, "p")
        assert all(before.values()) and _once(before) == P_KEYS

        with pytest.raises(ScaleDownError, match=r"scale\(1\) failed, the replay keeps its 3 "
                           r"shards: shard 1 could not hand its rows over \(shard 0 refused "
                           r"rows of table 'v' \(\d+ rows had moved\): SchemaMismatchError.*"
                           r"serves again .*every row is stored once; shard 2 moved all its "
                           r"rows \('p': \d+, 'v': 0\) and serves again, empty"):
            replay.scale(1)

        states = replay.states()  # the shards that were to go serve again, anew
        assert [s["state"] for s in states] == ["serving"] * 3
        assert [s["incarnation"] for s in states[1:]] == [first[1]["incarnation"] + 1,
                                                          first[2]["incarnation"] + 1]
        assert replay.num_shards == 3 and ReplayCluster.get("refused").num_shards == 3
        after = _keys(replay, "p")
        assert _once(after) == P_KEYS and after[1] == after[2] == []  # moved, once
        assert _keys(replay, "v")[1] == V_KEYS  # shard 1's 'v' rows stayed
        with replay.client() as strict:  # the whole replay serves
            batch = strict.sample("p", 64)
            assert batch.missing_shards == () and set((batch.ids >> 56).tolist()) == {0}
            assert strict.info()["p"].size == len(P_KEYS)

        if crash:  # a crash now brings no moved row back
            ray.kill(replay.shards[1], no_restart=False)
            assert wait_for(lambda: replay.states()[1]["incarnation"] > states[1]["incarnation"]
                            and replay.states()[1]["state"] == "serving", timeout=90)
            assert _keys(replay, "p")[1] == [] and _keys(replay, "v")[1] == V_KEYS

        with ReplayClient(replay.states()[0]["address"]) as shard0:
            shard0.reset("v", schema=True)  # the cause removed
        handed = replay.scale(1)
        assert handed[1]["moved"] == {"p": 0, "v": len(V_KEYS)}
        assert handed[2]["moved"] == {"p": 0, "v": 0}
        assert replay.num_shards == 1 and [s["index"] for s in replay.states()] == [0]
        assert sorted(_keys(replay, "p")[0]) == P_KEYS  # every row exactly once
        assert _keys(replay, "v") == {0: V_KEYS}
        assert loopback_addresses() == {"127.0.0.1"}
    finally:
        replay.shutdown()
