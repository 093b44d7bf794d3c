"""RLlib's DQN (new API stack) on CartPole with its replay in 2 shards on a loopback Ray cluster.

The buffer is swapped by its dotted path, as an RLlib user would; the
algorithm makes the replay (``ReplayCluster.create(get_if_exists=True)``) with
one shard on each node. A few training iterations run; the rows are on both
shards and the learner's TD errors reach them as priority updates (each
shard's counter, and a draw that is no longer uniform). A longer run that
must learn is marked slow (``make soak``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.server.ray.conftest import NODE_A, NODE_B, SKIP_REASON, loopback_addresses

ray = pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)
pytest.importorskip("ray.rllib", reason="RLlib is not importable: pip install "
                    "'replay-server[rllib]' (ray[rllib]: dm-tree, scipy, pyarrow, ...)",
                    exc_type=ImportError)

from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402

from replay_server.ray import ReplayCluster  # noqa: E402

BUFFER = "replay_server.ray.rllib.ShardedEpisodeReplayBuffer"


def dqn(replay: str, *, steps_per_iteration: int, learning_starts: int, fragment: int,
        seed: int = 0, client_options: dict | None = None):
    """DQN on CartPole, everything in this process but the shards (one per node): one
    update of 32 rows per ``fragment`` environment steps."""
    return (DQNConfig()
            .environment("CartPole-v1")
            .framework("torch")
            .env_runners(num_env_runners=0, rollout_fragment_length=fragment)
            .learners(num_learners=0)
            .debugging(seed=seed)
            .reporting(min_sample_timesteps_per_iteration=steps_per_iteration,
                       min_time_s_per_iteration=0)
            .training(train_batch_size_per_learner=32, lr=5e-4, n_step=1,
                      num_steps_sampled_before_learning_starts=learning_starts,
                      target_network_update_freq=500,
                      replay_buffer_config={
                          "type": BUFFER, "capacity": 20_000, "alpha": 0.6, "beta": 0.4,
                          "replay": replay, "num_shards": 2, "n_step": 1,
                          "shard_options": [{"num_cpus": 0, "resources": NODE_A},
                                            {"num_cpus": 0, "resources": NODE_B}],
                          "checkpoint_interval_s": 0,
                          "client_options": client_options or {}})
            .build_algo())


def test_dqn_trains_on_two_shards_and_its_priorities_reach_them(ray_cluster) -> None:
    algo = dqn("dqn", steps_per_iteration=200, learning_starts=100, fragment=50)
    replay = ReplayCluster.get("dqn")
    try:
        buffer = algo.local_replay_buffer
        assert type(buffer).__module__ + "." + type(buffer).__name__ == BUFFER
        result = algo.train()  # 200 steps, an update per 50 from the 100th: 2-3 updates
        buffer.flush()  # the last add and the updates riding on the sample stream, applied
        assert len({s["node_id"] for s in replay.states()}) == 2  # one shard per node
        assert all(s["address"].startswith("127.0.0.1:") for s in replay.states())
        assert loopback_addresses() == {"127.0.0.1"}
        with replay.client() as client:
            shards = client.shard_info()
            sizes = {i: info.tables["rllib"].size for i, info in shards.items()}
            updates = {i: info.tables["rllib"].counters["priority_updates"]
                       for i, info in shards.items()}
            assert sum(sizes.values()) == result["env_runners"][
                "num_env_steps_sampled_lifetime"] >= 200
            # Every shard holds rows; the learner's TD errors reached the replay (2-3 updates
            # of 32 ids, each id applied on the shard that owns it). Which shards the sampled
            # rows came from follows their share of the mass: with 16 of 200 rows on one shard
            # (the inserts' placement), 96 ids drawn from the other alone happen.
            assert min(sizes.values()) > 0 and sum(updates.values()) >= 64, (sizes, updates)
            batch = client.sample("rllib", 512)  # TD errors differ: the draw is not uniform
            assert np.ptp(batch.probabilities.numpy()) > 0
        assert result["replay_buffer"]["num_priorities_updated"] > 0  # RLlib's metrics
    finally:
        algo.stop()
        replay.shutdown()


@pytest.mark.slow
def test_dqn_learns_cartpole_through_the_shards(ray_cluster) -> None:
    # A long run on a loaded machine: a shard may be slower than the client's 2 s per-shard
    # deadline now and then (UnavailableError), which is not what this test is about.
    algo = dqn("dqn-learn", steps_per_iteration=1000, learning_starts=1000, fragment=4,
               seed=1, client_options={"shard_deadline_s": 60})
    replay = ReplayCluster.get("dqn-learn")
    try:
        best = 0.0
        for _ in range(60):  # at most 60,000 environment steps
            result = algo.train()
            best = max(best, result["env_runners"].get("episode_return_mean", 0.0))
            if best >= 150:
                break
        assert best >= 150, best
    finally:
        algo.stop()
        replay.shutdown()
