"""``ShardedMultiAgentEpisodeReplayBuffer`` against RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer``.

Both buffers get the same episodes of RLlib's two-agent CartPole (agent 0 ->
module ``p0``, agent 1 -> ``p1``; whole episodes, and a running one in two
chunks); ours stores them in a real replay server on 127.0.0.1 (``address=``:
no Ray cluster is needed), one table per module. Checked: each module's
samples come only from its module's rows and carry its ids; a priority update
of one module moves only that module's table, and leaves the priorities RLlib's
module segment tree holds after the same update of the same rows; the counts
and add metrics RLlib reports; refusals by name that store nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.server.ray.conftest import SKIP_REASON

pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)
pytest.importorskip("ray.rllib", reason="RLlib is not importable: pip install "
                    "'replay-server[rllib]' (ray[rllib]: dm-tree, scipy, pyarrow, ...)",
                    exc_type=ImportError)

from ray.rllib.env.multi_agent_episode import MultiAgentEpisode  # noqa: E402
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole  # noqa: E402
from ray.rllib.utils.replay_buffers import (  # noqa: E402
    MultiAgentPrioritizedEpisodeReplayBuffer,
)

from replay_server.app.config_file import settings_from_dict  # noqa: E402
from replay_server.app.embedded import EmbeddedServer  # noqa: E402
from replay_server.errors import ConfigError  # noqa: E402
from replay_client.errors import WriterError  # noqa: E402
from replay_server.ray.rllib_multi import ShardedMultiAgentEpisodeReplayBuffer  # noqa: E402
from replay_server.ray.rllib_multi_env_runner import written_of  # noqa: E402
from replay_server.ray.rllib_rows import episode_number, rows_of  # noqa: E402
from replay_server.ray.rllib_written import WriteFailure  # noqa: E402
from tests.server.ray.test_rllib_buffer import cartpole_episodes  # noqa: E402

ALPHA, BETA = 0.6, 0.4
MODULES = ["p0", "p1"]


def mapping(agent_id, episode=None, **kwargs) -> str:
    return f"p{agent_id}"


def two_agent_episodes(seed: int = 0, steps: int = 200) -> list[MultiAgentEpisode]:
    """Two-agent CartPole under random actions (each agent's episode ends on its own, the
    multi-agent one when both have): every finished episode, then the running one in two
    chunks, as env runners hand them to the algorithm."""
    env = MultiAgentCartPole({"num_agents": 2})
    rng = np.random.default_rng(seed)

    def fresh(obs, infos) -> MultiAgentEpisode:
        episode = MultiAgentEpisode(observation_space=env.observation_spaces,
                                    action_space=env.action_spaces,
                                    agent_to_module_mapping_fn=mapping)
        episode.add_env_reset(observations=obs, infos=infos)
        return episode

    episode = fresh(*env.reset(seed=seed))
    out = []
    for step in range(steps):
        actions = {aid: int(rng.integers(2)) for aid in episode.get_agents_to_act()}
        obs, rewards, terminateds, truncateds, infos = env.step(actions)
        episode.add_env_step(obs, actions, rewards, infos, terminateds=terminateds,
                             truncateds=truncateds)
        if episode.is_done:
            out.append(episode.to_numpy())
            episode = fresh(*env.reset())
        elif step == steps - 6:  # the running episode's first chunk
            successor = episode.cut()
            out.append(episode.to_numpy())
            episode = successor
    out.append(episode.to_numpy())
    return out


def transitions(episodes) -> dict[str, dict[tuple[str, int], tuple]]:
    """Every one-step transition each module's rows hold: by module, (agent episode id, t)
    -> obs, action, reward, next obs, terminated."""
    found: dict[str, dict] = {m: {} for m in MODULES}
    for ma in episodes:
        for aid, e in ma.agent_episodes.items():
            observations = e.get_observations(slice(0, len(e) + 1))
            for i in range(len(e)):
                found[mapping(aid)][(e.id_, e.t_started + i)] = (
                    np.asarray(observations[i]), int(e.get_actions(i)),
                    float(e.get_rewards(i)), np.asarray(observations[i + 1]),
                    bool(e.is_terminated) and i == len(e) - 1)
    return found


@pytest.fixture()
def server(tmp_path):
    tables = [{"name": f"rllib-{m}", "capacity": 2000, "sampler": "prioritized",
               "alpha": ALPHA, "beta": BETA} for m in MODULES]
    tables.append({"name": "flat-p0", "capacity": 100, "sampler": "uniform"})
    server = EmbeddedServer(settings_from_dict({"server": {
        "address": "127.0.0.1:0", "checkpoint_dir": str(tmp_path), "shared_memory": False},
        "tables": tables}))
    assert server.address.startswith("127.0.0.1:")
    yield server
    server.close()


def buffer_on(server, **options) -> ShardedMultiAgentEpisodeReplayBuffer:
    options.setdefault("module_ids", MODULES)
    return ShardedMultiAgentEpisodeReplayBuffer(capacity=2000, alpha=ALPHA, beta=BETA,
                                                address=server.address, **options)


def reference(episodes) -> MultiAgentPrioritizedEpisodeReplayBuffer:
    ref = MultiAgentPrioritizedEpisodeReplayBuffer(capacity=2000, alpha=ALPHA)
    ref.add(episodes)
    return ref


def test_each_module_samples_only_its_rows_and_says_whose(server) -> None:
    episodes = two_agent_episodes()
    ours, ref = buffer_on(server), reference(episodes)
    ours.add(episodes)
    for module in MODULES:
        assert ours.get_num_timesteps(module) == ref.get_num_timesteps(module) > 0
        assert ours.get_num_episodes(module) == ref.get_num_episodes(module)
        assert ours.get_added_timesteps(module) == ref.get_added_timesteps(module)
        assert ours.client.info()[f"rllib-{module}"].size == ref.get_num_timesteps(module)
    assert ours.get_num_episodes() == ref.get_num_episodes()
    expected = transitions(episodes)
    ids = {e.id_: (aid, ma.id_) for ma in episodes for aid, e in ma.agent_episodes.items()}
    sampled = ours.sample(num_items=64, beta=BETA, n_step=1, sample_episodes=True)
    assert [e.module_id for e in sampled] == ["p0"] * 64 + ["p1"] * 64
    for e in sampled:
        obs, action, reward, next_obs, terminated = expected[e.module_id][(e.id_, e.t_started)]
        assert (e.agent_id, e.multi_agent_episode_id) == ids[e.id_]
        assert e.module_id == mapping(e.agent_id)
        assert np.array_equal(e.get_observations(0), obs)
        assert np.array_equal(e.get_observations(1), next_obs)
        assert int(e.get_actions(0)) == action and float(e.get_rewards(0)) == reward
        assert e.is_terminated == terminated
        assert e.extra_model_outputs["weights"][0] == pytest.approx(1.0)  # all priorities 1
    for module in MODULES:  # one agent episode's rows together, as RLlib's learner batches
        keys = [(e.multi_agent_episode_id, e.agent_id) for e in sampled if e.module_id == module]
        runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
        assert len(runs) == len(set(keys)), keys
    assert ours.sample(num_items=8, modules_to_sample=["p1"])[0].module_id == "p1"


def _module_nodes(ref, module: str) -> dict[tuple[str, int], int]:
    """(agent episode id, t) -> the row's node in RLlib's segment trees of ``module``."""
    nodes = {}
    for ma_idx, agent_id, ts, node in ref._module_to_indices[module]:
        episode = ref.episodes[ma_idx - ref._num_episodes_evicted].agent_episodes[agent_id]
        nodes[(episode.id_, episode.t_started + ts)] = node
    return nodes


@pytest.mark.parametrize("prefetch", [2, 0], ids=["stream", "calls"])
def test_updating_one_module_moves_only_its_table_as_rllib_tree(server, prefetch) -> None:
    episodes = two_agent_episodes(seed=2)
    ours, ref = buffer_on(server, prefetch=prefetch), reference(episodes)
    ours.add(episodes)
    nodes = _module_nodes(ref, "p0")
    for round_ in range(3):
        sampled = [e for e in ours.sample(num_items=32, beta=BETA) if e.module_id == "p0"]
        td = np.abs(np.sin(np.arange(32) + round_)) * 3  # TD errors, a few near 0
        # the k-th TD error for the k-th row returned, in RLlib's tree too
        ref._module_to_last_sampled_indices["p0"] = [nodes[(e.id_, e.t_started)]
                                                     for e in sampled]
        ref.update_priorities(td, "p0")
        ours.update_priorities(td, "p0")
    ours.flush()
    info = ours.client.info()
    assert info["rllib-p0"].counters["priority_updates"] > 0
    assert info["rllib-p1"].counters["priority_updates"] == 0
    untouched = ours.client.sample("rllib-p1", 256).probabilities.numpy()
    assert np.allclose(untouched, 1 / ours.get_num_timesteps("p1"))  # still all equal
    tree, n = ref._module_to_sum_segment["p0"], ref.get_num_timesteps("p0")
    total = tree.sum()
    max_weight = (ref._module_to_min_segment["p0"].min() / total * n) ** -BETA
    batch = ours.client.sample("rllib-p0", 256)
    names = {episode_number(e.id_): e.id_ for ma in episodes
             for e in ma.agent_episodes.values()}
    for number, t, p, w in zip(batch.columns["episode"].tolist(), batch.columns["t"].tolist(),
                               batch.probabilities.tolist(), batch.weights.tolist()):
        want = tree[nodes[(names[number], t)]] / total
        assert p == pytest.approx(want, rel=1e-6)
        assert w == pytest.approx((want * n) ** -BETA / max_weight, rel=1e-5)
    assert ours.get_metrics()["num_priorities_updated"] == 96


def test_add_metrics_are_rllib_metrics(server) -> None:
    episodes = two_agent_episodes(seed=3)
    ours, ref = buffer_on(server), reference([])
    ours.add(episodes)
    ref.add(episodes)
    mine, theirs = ours.get_metrics(), ref.get_metrics()
    assert set(mine) == set(theirs)
    for key in ("num_env_steps_added", "num_episodes_added", "num_module_steps_added",
                "num_module_episodes_added", "num_agent_steps_added", "num_agent_episodes_added"):
        assert _peek(mine[key]) == _peek(theirs[key]), key
    # RLlib's counts environment steps, ours agent steps: each table's rows (documented)
    assert _peek(mine["num_env_steps_stored"]) == sum(
        _peek(theirs["num_module_steps_added"]).values())
    ours.sample(num_items=16)
    ref.sample(num_items=16, beta=BETA)
    mine, theirs = ours.get_metrics(), ref.get_metrics()
    assert set(mine) == set(theirs)
    for key in ("num_module_steps_sampled", "num_agent_steps_sampled", "num_env_steps_sampled"):
        assert _peek(mine[key]) == _peek(theirs[key]), key


def _peek(stats):
    """A metric's value (or each module's / agent's), as RLlib's results show it."""
    return {k: v.peek() for k, v in stats.items()} if isinstance(stats, dict) else stats.peek()


def test_what_it_cannot_do_is_refused_by_name_and_loses_nothing(server) -> None:
    ours = buffer_on(server)
    ours.add(two_agent_episodes(seed=4, steps=40))
    sizes = {m: ours.get_num_timesteps(m) for m in MODULES}
    three = MultiAgentCartPole({"num_agents": 3})
    stray = MultiAgentEpisode(agent_to_module_mapping_fn=mapping)
    stray.add_env_reset(observations=three.reset(seed=0)[0])
    stray.add_env_step(*three.step({0: 0, 1: 0, 2: 0})[:4])
    with pytest.raises(ConfigError, match=r"agent 2 of episode .* maps to module 'p2', not "
                                          r"one of module_ids \['p0', 'p1'\]"):
        ours.add([*two_agent_episodes(seed=5, steps=20), stray])
    with pytest.raises(TypeError, match="got SingleAgentEpisode"):
        ours.add([*two_agent_episodes(seed=6, steps=20), *cartpole_episodes(steps=10)])
    with pytest.raises(ValueError, match="weight -1.0 for module 'p0'"):
        ours.add(two_agent_episodes(seed=7, steps=20), weight={"p0": -1.0})
    assert {m: ours.get_num_timesteps(m) for m in MODULES} == sizes  # nothing stored
    with pytest.raises(ValueError, match="replay_mode='synchronized'"):
        ours.sample(num_items=8, replay_mode="synchronized")
    for call in (lambda: ours.sample(num_items=8, modules_to_sample=["p0", "p9"]),
                 lambda: ours.update_priorities(np.ones(8), "p9"),
                 lambda: ours.get_num_timesteps("p9")):
        with pytest.raises(ConfigError, match=r"module 'p9' is not one of this buffer's "
                                              r"module_ids \['p0', 'p1'\]"):
            call()
    ours.sample(num_items=8)
    with pytest.raises(ValueError, match=r"7 priorities for the 8 rows"):
        ours.update_priorities(np.ones(7), "p1")
    ours.update_priorities(np.ones(8), "p1")
    with pytest.raises(ConfigError, match=r"module 'p9': the replay has no table 'rllib-p9'"):
        buffer_on(server, module_ids=["p0", "p9"])
    with pytest.raises(ConfigError, match=r"module 'p0': table 'flat-p0' samples 'uniform'"):
        buffer_on(server, table_prefix="flat-")
    for bad in (None, "p0", [], ["p0", "p0"], ["p0", 1]):
        with pytest.raises(ConfigError, match="module_ids"):
            buffer_on(server, module_ids=bad)
    assert {m: ours.get_num_timesteps(m) for m in MODULES} == sizes


def test_state_holds_checkpoint_paths_and_counters(server, tmp_path) -> None:
    ours = buffer_on(server)
    ours.add(two_agent_episodes(seed=8, steps=60))
    ours.sample(num_items=8)
    state = ours.get_state()
    assert [p for p in state["checkpoints"].values() if str(tmp_path) in p]
    again = buffer_on(server)
    again.set_state(state)
    for module in MODULES:
        assert again.get_num_episodes(module) == ours.get_num_episodes(module) > 0
        assert again.get_added_timesteps(module) == ours.get_added_timesteps(module)
        assert again.get_sampled_timesteps(module) == 8
    drawn = again.sample(num_items=4)  # the agent episodes' keys came back with the state
    assert {e.agent_id for e in drawn} == {0, 1}
    with pytest.raises(ValueError, match=r"the state is of tables \{'p0': 'rllib-p0', "
                                         r"'p1': 'rllib-p1'\}.*this buffer's are \{'p0'"):
        buffer_on(server, module_ids=["p0"]).set_state(state)


def test_episodes_an_env_runner_wrote_are_counted_as_rllib_counts_them(server) -> None:
    """What a ``ShardedMultiAgentEnvRunner`` hands the driver (``written_of``: ids and
    step counts, its rows inserted by the env runner): the buffer sends nothing, counts
    each module's steps and episodes as RLlib's buffer counts the episodes themselves, and
    samples those rows with their agents' ids. A ``WriteFailure`` among them is raised
    after the rest is counted; a part of a module it has no table for is refused."""
    episodes = two_agent_episodes(seed=3)
    ours, ref = buffer_on(server), reference(episodes)
    written, by_module = written_of(episodes, MODULES, set())
    for module, parts in by_module.items():  # what the env runner's writer inserts
        ours.client.insert(f"rllib-{module}", rows_of(parts))
    with pytest.raises(WriterError, match="env runner 1's sample: shard 0 refused"):
        ours.add([*written, WriteFailure("env runner 1's sample: shard 0 refused")])
    assert ours.rows_sent == 0
    assert ours.rows_written_by_env_runners == sum(ref.get_num_timesteps(m) for m in MODULES)
    for module in MODULES:
        assert ours.get_num_timesteps(module) == ref.get_num_timesteps(module) > 0
        assert ours.get_num_episodes(module) == ref.get_num_episodes(module)
        assert ours.get_added_timesteps(module) == ref.get_added_timesteps(module)
    assert ours.get_num_episodes() == ref.get_num_episodes()
    ids = {e.id_: (aid, ma.id_) for ma in episodes for aid, e in ma.agent_episodes.items()}
    for episode in ours.sample(num_items=32, beta=BETA, n_step=1):
        assert ids[episode.id_] == (episode.agent_id, episode.multi_agent_episode_id)
        assert episode.observation_space is not None  # the spaces came with the parts
    with pytest.raises(ConfigError, match=r"module 'p1', not one of module_ids \['p0'\]"):
        written_of(episodes, ["p0"], set())
