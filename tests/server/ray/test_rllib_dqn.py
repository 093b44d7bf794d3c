"""RLlib's DQN (new API stack) on CartPole with its replay in 2 shards on a loopback Ray cluster.

The buffer is swapped by its dotted path, as an RLlib user would; the
algorithm makes the replay (``ReplayCluster.create(get_if_exists=True)``) with
one shard on each node. A few training iterations run; the rows are on both
shards and the learner's TD errors reach them as priority updates (each
shard's counter, and a draw that is no longer uniform). The same with two
agents of CartPole, each its own module, through the multi-agent buffer: one
table per module. With a remote ``ShardedEnvRunner`` the env runner writes its samples to
the shards itself and the driver's add sends none, and with a remote
``ShardedDQNTorchLearner`` (``learners_draw``) the learner draws its batches from the
shards itself: no row passes through the driver; an env runner whose rows a shard refuses
makes the driver's next add raise. A longer run that must learn is marked slow
(``make soak``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.server.ray.conftest import NODE_A, NODE_B, SKIP_REASON, loopback_addresses

ray = pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)
pytest.importorskip("ray.rllib", reason="RLlib is not importable: pip install "
                    "'replay-server[rllib]' (ray[rllib]: dm-tree, scipy, pyarrow, ...)",
                    exc_type=ImportError)

from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole  # noqa: E402

from replay_client.errors import WriterError  # noqa: E402
from replay_server.errors import ConfigError  # noqa: E402
from replay_server.ray import ReplayCluster  # noqa: E402
from replay_server.ray.rllib import ShardedEpisodeReplayBuffer  # noqa: E402
from replay_server.ray.rllib_env_runner import ShardedEnvRunner, flush_env_runners  # noqa: E402
from replay_server.ray.rllib_learner import ShardedDQNTorchLearner  # noqa: E402
from replay_server.ray.rllib_multi_env_runner import ShardedMultiAgentEnvRunner  # noqa: E402

BUFFER = "replay_server.ray.rllib.ShardedEpisodeReplayBuffer"
MULTI_BUFFER = "replay_server.ray.rllib_multi.ShardedMultiAgentEpisodeReplayBuffer"


def dqn(replay: str, *, steps_per_iteration: int, learning_starts: int, fragment: int,
        seed: int = 0, client_options: dict | None = None, env_runners: int = 0,
        buffer: dict | None = None, learners_draw: bool = False):
    """DQN on CartPole, everything in this process but the shards (one per node): one
    update of 32 rows per ``fragment`` environment steps. ``env_runners`` > 0: that many
    remote ``ShardedEnvRunner``s (half a CPU each), writing to the shards themselves, and
    an env runner's error fails ``train()`` (no restart). ``learners_draw``: one remote
    ``ShardedDQNTorchLearner`` (half a CPU) drawing the train batches from the shards."""
    runners = ({"num_env_runners": env_runners, "env_runner_cls": ShardedEnvRunner,
                "num_cpus_per_env_runner": 0.5} if env_runners else {"num_env_runners": 0})
    learners = ({"num_learners": 1, "num_cpus_per_learner": 0.5,
                 "learner_class": ShardedDQNTorchLearner} if learners_draw
                else {"num_learners": 0})
    buffer = {**(buffer or {}), **({"learners_draw": True} if learners_draw else {})}
    return (DQNConfig()
            .environment("CartPole-v1")
            .framework("torch")
            .env_runners(rollout_fragment_length=fragment, **runners)
            .fault_tolerance(restart_failed_env_runners=False)
            .learners(**learners)
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
                          "client_options": client_options or {}, **buffer})
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
            # (Each episode goes whole to one shard by its id's hash: with n episodes, all on
            # one shard has chance 2 ** (1 - n); the episode count is in the message.)
            episodes = result["env_runners"].get("num_episodes_lifetime")
            assert min(sizes.values()) > 0 and sum(updates.values()) >= 64, (sizes, updates,
                                                                              episodes)
            batch = client.sample("rllib", 512)  # TD errors differ: the draw is not uniform
            assert np.ptp(batch.probabilities.numpy()) > 0
        assert result["replay_buffer"]["num_priorities_updated"] > 0  # RLlib's metrics
    finally:
        algo.stop()
        replay.shutdown()


def test_env_runners_write_and_learners_draw_so_no_row_passes_through_the_driver(
        ray_cluster) -> None:
    """RLlib's scale path: a remote ``ShardedEnvRunner`` inserts what it samples into the
    shards itself (the driver's buffer counts their rows and sends none), and a remote
    ``ShardedDQNTorchLearner`` draws each train batch from the shards itself (the driver's
    buffer orders the rows and draws none). The shards hold every env step RLlib counts as
    sampled, and the learner's TD errors reach them as priorities."""
    algo = dqn("dqn-runners", steps_per_iteration=200, learning_starts=100, fragment=50,
               env_runners=1, learners_draw=True)  # a second runner: ~20 s more on 2 cores
    replay = ReplayCluster.get("dqn-runners")
    try:
        buffer = algo.local_replay_buffer
        result = algo.train()
        result = algo.train()  # 400+ steps, an update per 100 from the 100th
        flush_env_runners(algo)  # the env runners' inserts on their way, stored
        buffer.flush()  # the updates riding on the sample stream, applied
        sampled = result["env_runners"]["num_env_steps_sampled_lifetime"]
        assert sampled >= 400
        assert buffer.rows_sent == 0  # the driver's add sent no row
        assert buffer.rows_written_by_env_runners == sampled
        assert not algo.learner_group.is_local  # the learner is an actor of its own
        ordered = result["replay_buffer"]["num_rows_ordered_from_learners"]
        assert ordered > 0 and buffer._rows.last_ids.numel() == 0  # the driver drew none
        written = result["replay_buffer"]["num_env_steps_written_by_env_runners"]
        assert 0 < written <= sampled, written  # RLlib's metrics: this iteration's
        assert loopback_addresses() == {"127.0.0.1"}
        with replay.client() as client:
            shards = client.shard_info()
            sizes = {i: info.tables["rllib"].size for i, info in shards.items()}
            updates = sum(info.tables["rllib"].counters["priority_updates"]
                          for info in shards.values())
            assert sum(sizes.values()) == sampled == buffer.get_num_timesteps(), sizes
            assert min(sizes.values()) > 0 and updates >= 64, (sizes, updates)
            rows = client.sample("rllib", 512)
            assert np.ptp(rows.probabilities.numpy()) > 0  # the TD errors are priorities
            assert set(rows.data["t"].tolist()) > {0}  # chunks of running episodes went on
        # The priorities came from the learner's own stream (the shards' counters above),
        # none through the driver's buffer.
        assert "num_priorities_updated" not in result["replay_buffer"]
    finally:
        algo.stop()
        replay.shutdown()


def test_an_env_runner_whose_rows_a_shard_refuses_fails_the_next_add(ray_cluster) -> None:
    """A replay whose table has another schema refuses an env runner's rows: its next
    sample steps no environment and hands the driver the failure, which the buffer's add
    raises as ``WriterError`` naming the env runner, the rows, the shard and the keys;
    nothing of the refused rows is stored. (The env runner runs in this process, as a
    local one does: RLlib 2.60 turns any error inside a remote one into ActorDiedError.)
    An env runner for a buffer that could not take what it returns is refused by name."""
    replay = ReplayCluster.create(
        "dqn-refuse", tables=[{"name": "rllib", "capacity": 1_000, "sampler": "prioritized"}],
        num_shards=1, shard_options={"num_cpus": 0}, checkpoint_interval_s=0)
    runner = buffer = None
    try:
        with replay.client() as client:  # the table's schema: obs of 8 floats
            client.insert("rllib", {"obs": torch.zeros(2, 8), "episode": torch.arange(2)})
        config = (DQNConfig().environment("CartPole-v1").framework("torch")
                  .env_runners(rollout_fragment_length=50)
                  .training(replay_buffer_config={"type": BUFFER, "address": replay.address,
                                                  "capacity": 1_000}))
        with pytest.raises(ConfigError, match="must be 'replay_server.ray.rllib.Sharded"):
            ShardedEnvRunner(config=DQNConfig().environment("CartPole-v1"))  # RLlib's buffer
        with pytest.raises(ConfigError, match="needs a multi-agent config .*single-agent"):
            ShardedMultiAgentEnvRunner(config=config)  # single-agent, the wrong buffer type
        buffer = ShardedEpisodeReplayBuffer(capacity=1_000, address=replay.address)
        runner = ShardedEnvRunner(config=config, worker_index=1)
        buffer.add(runner.sample())  # its insert is on its way, refused by the shard
        runner.flush()
        failed = runner.sample()
        assert [type(e).__name__ for e in failed] == ["WriteFailure"]
        with pytest.raises(WriterError) as raised:
            buffer.add(failed)
        message = str(raised.value)
        assert "env runner 1" in message and "50 rows" in message, message
        assert "shard 0" in message and "'action'" in message, message
        with pytest.raises(WriterError):  # and again: never silently dropped
            buffer.add(runner.sample())
        assert buffer.rows_sent == 0 and buffer.rows_written_by_env_runners == 50
        with replay.client() as client:
            assert client.info()["rllib"].size == 2  # nothing of the refused rows stored
    finally:
        for closing in (runner, buffer):
            if closing is not None:
                closing.stop() if closing is runner else closing.close()
        replay.shutdown()


def test_multi_agent_dqn_keeps_each_module_in_its_table_on_two_shards(ray_cluster) -> None:
    """Two agents of CartPole, each its own module (policy ``p0``, ``p1``): each module's
    rows go to its own table over the two shards, and its TD errors to its table only; the
    rows a sample returns are in the order RLlib's learner batches them (so the k-th TD
    error is the k-th row's). The env runner (``ShardedMultiAgentEnvRunner``, the local one
    here: a remote one costs seconds to start) writes each module's rows itself; the
    buffer's add counts them and sends none."""
    algo = (DQNConfig()
            .environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .framework("torch")
            .multi_agent(policies={"p0", "p1"},
                         policy_mapping_fn=lambda agent_id, episode, **kw: f"p{agent_id}")
            .env_runners(num_env_runners=0, rollout_fragment_length=50,
                         env_runner_cls=ShardedMultiAgentEnvRunner)
            .learners(num_learners=0)
            .debugging(seed=0)
            .reporting(min_sample_timesteps_per_iteration=200, min_time_s_per_iteration=0)
            .training(train_batch_size_per_learner=32, n_step=1,
                      num_steps_sampled_before_learning_starts=100,
                      replay_buffer_config={
                          "type": MULTI_BUFFER, "capacity": 20_000, "alpha": 0.6,
                          "beta": 0.4, "module_ids": ["p0", "p1"], "replay": "dqn-ma",
                          "num_shards": 2, "checkpoint_interval_s": 0,
                          "shard_options": [{"num_cpus": 0, "resources": NODE_A},
                                            {"num_cpus": 0, "resources": NODE_B}]})
            .build_algo())
    replay = ReplayCluster.get("dqn-ma")
    try:
        buffer = algo.local_replay_buffer
        assert type(buffer).__module__ + "." + type(buffer).__name__ == MULTI_BUFFER
        algo.train()  # 200 environment steps, an update per 50 from the 100th: 2-3 updates
        flush_env_runners(algo)  # the env runner's inserts on their way, stored
        buffer.flush()  # the updates riding on the sample streams, applied
        assert buffer.rows_sent == 0 and buffer.rows_written_by_env_runners > 0
        assert all(s["address"].startswith("127.0.0.1:") for s in replay.states())
        assert loopback_addresses() == {"127.0.0.1"}
        with replay.client() as client:
            shards = client.shard_info()
            per_shard = [0] * len(shards)
            assert sum(buffer.get_added_timesteps(m) for m in ("p0", "p1")) == \
                buffer.rows_written_by_env_runners  # every agent step, written by the runner
            for module in ("p0", "p1"):
                table = f"rllib-{module}"
                sizes = [info.tables[table].size for info in shards.values()]
                updates = sum(info.tables[table].counters["priority_updates"]
                              for info in shards.values())
                # its agent's steps in its own table; 2-3 updates of 32 of its ids
                assert sum(sizes) == buffer.get_added_timesteps(module) > 0
                assert updates >= 64, (module, sizes, updates)
                assert np.ptp(client.sample(table, 512).probabilities.numpy()) > 0
                per_shard = [a + b for a, b in zip(per_shard, sizes, strict=True)]
            # rows go to a shard by episode: one module's few episodes may all land on one
            # (a clean-clone CI: p1's 159 rows on shard 0), the replay's rows use both
            assert min(per_shard) > 0, per_shard
        episodes = buffer.sample(num_items=32)
        learner = algo.learner_group._learner  # the local learner (num_learners=0)
        batch = learner._learner_connector(rl_module=learner.module, batch={},
                                           episodes=episodes, shared_data={})
        for module in ("p0", "p1"):
            ours = np.stack([e.get_observations(0) for e in episodes if e.module_id == module])
            assert np.array_equal(np.asarray(batch[module][Columns.OBS]), ours), module
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
