"""``ShardedEpisodeReplayBuffer`` against RLlib's own ``PrioritizedEpisodeReplayBuffer``.

Both buffers get the same CartPole episodes (whole ones, and a running
episode in two chunks); the sharded one stores them in a real replay server
on 127.0.0.1 (``address=``: no Ray cluster is needed for the buffer's own
behaviour). Checked against RLlib's: what a sample holds (each transition one
RLlib's buffer could return, n-step returns as RLlib computes them), the
priorities and importance weights after the same updates of the same rows
(read from RLlib's segment tree), the metrics RLlib's algorithm aggregates,
and the errors where this buffer cannot do what was asked.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.server.ray.conftest import SKIP_REASON

pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)
pytest.importorskip("ray.rllib", reason="RLlib is not importable: pip install "
                    "'replay-server[rllib]' (ray[rllib]: dm-tree, scipy, pyarrow, ...)",
                    exc_type=ImportError)

import gymnasium as gym  # noqa: E402
import scipy.signal  # noqa: E402
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import PrioritizedEpisodeReplayBuffer  # noqa: E402

from replay_client.errors import WriterError  # noqa: E402
from replay_server.app.config_file import settings_from_dict  # noqa: E402
from replay_server.app.embedded import EmbeddedServer  # noqa: E402
from replay_server.errors import ConfigError  # noqa: E402
from replay_server.ray.rllib import ShardedEpisodeReplayBuffer, episode_number  # noqa: E402

ALPHA, BETA, GAMMA = 0.6, 0.4, 0.9


def cartpole_episodes(seed: int = 0, steps: int = 300) -> list[SingleAgentEpisode]:
    """CartPole under random actions: every finished episode, then the running one in two
    chunks (``cut``), as env runners hand them to the algorithm."""
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    episode = SingleAgentEpisode(observation_space=env.observation_space,
                                 action_space=env.action_space)
    episode.add_env_reset(obs, info)
    out = []  # in the order an algorithm receives them
    for step in range(steps):
        action = int(rng.integers(2))
        obs, reward, terminated, truncated, info = env.step(action)
        episode.add_env_step(obs, action, reward, info, terminated=terminated,
                             truncated=truncated)
        if terminated or truncated:
            out.append(episode.to_numpy())
            episode = SingleAgentEpisode(observation_space=env.observation_space,
                                         action_space=env.action_space)
            obs, info = env.reset()
            episode.add_env_reset(obs, info)
        elif step == steps - 6:  # the running episode's first chunk
            successor = episode.cut()
            out.append(episode.to_numpy())
            episode = successor
    out.append(episode.to_numpy())
    return out


def transitions(episodes: list[SingleAgentEpisode], n: int = 1) -> dict[tuple[int, int], tuple]:
    """Every n-step transition RLlib's buffer can return, by (episode number, t): obs, action,
    return (lfilter, as RLlib sums it), the observation n' steps on, n', terminated."""
    whole: dict[str, dict] = {}
    for e in episodes:  # chunks of one episode joined, as RLlib's buffer concatenates them
        part = whole.setdefault(e.id_, {"obs": [], "act": [], "rew": [], "t0": e.t_started})
        observations = list(e.get_observations(slice(0, len(e) + 1)))
        part["obs"] = (part["obs"][:-1] if part["obs"] else []) + observations
        part["act"] += list(e.get_actions(slice(0, len(e))))
        part["rew"] += list(e.get_rewards(slice(0, len(e))))
        part["terminated"] = e.is_terminated
    found = {}
    for id_, part in whole.items():
        steps = len(part["act"])
        for t in range(steps):
            m = min(n, steps - t)
            rewards = np.asarray(part["rew"][t:t + m], dtype=np.float32).astype(np.float64)
            ret = scipy.signal.lfilter([1], [1, -GAMMA], rewards[::-1], axis=0)[-1]
            found[(episode_number(id_), part["t0"] + t)] = (
                np.asarray(part["obs"][t]), int(part["act"][t]), float(ret),
                np.asarray(part["obs"][t + m]), m, part["terminated"] and t + m == steps)
    return found


@pytest.fixture()
def server(tmp_path):
    tables = [{"name": "rllib", "capacity": 2000, "sampler": "prioritized", "alpha": ALPHA,
               "beta": BETA},
              {"name": "nstep", "capacity": 2000, "sampler": "prioritized", "alpha": ALPHA,
               "n_step": 3, "gamma": GAMMA},
              {"name": "flat", "capacity": 100, "sampler": "uniform"},
              {"name": "small", "capacity": 100, "sampler": "prioritized", "alpha": ALPHA,
               "beta": BETA}]
    server = EmbeddedServer(settings_from_dict({"server": {
        "address": "127.0.0.1:0", "checkpoint_dir": str(tmp_path), "shared_memory": False},
        "tables": tables}))
    assert server.address.startswith("127.0.0.1:")
    yield server
    server.close()


def buffer_on(server, **options) -> ShardedEpisodeReplayBuffer:
    return ShardedEpisodeReplayBuffer(capacity=2000, alpha=ALPHA, beta=BETA,
                                      address=server.address, **options)


def reference(episodes) -> PrioritizedEpisodeReplayBuffer:
    ref = PrioritizedEpisodeReplayBuffer(capacity=2000, alpha=ALPHA)
    ref.add(episodes)
    return ref


def test_samples_are_the_transitions_rllib_buffer_returns(server) -> None:
    episodes = cartpole_episodes()
    ours, ref = buffer_on(server), reference(episodes)
    ours.add(episodes)
    assert len(ours) == ref.get_num_timesteps() == 300
    assert ours.get_num_episodes() == ref.get_num_episodes()
    expected = transitions(episodes)
    # Three samples each, checked after the last: a batch from the sample stream is a view
    # of its ring until the next one, so episodes that kept views would hold later rows.
    drawn = {source: [e for _ in range(3)
                      for e in source.sample(num_items=64, beta=BETA, gamma=GAMMA, n_step=1)]
             for source in (ref, ours)}
    for source in (ref, ours):  # the reference set is RLlib's own
        for e in drawn[source]:
            assert len(e) == 1 and e.extra_model_outputs["n_step"][0] == 1
            key = (None if source is ref else episode_number(e.id_), e.t_started)
            obs, action, ret, next_obs, _, terminated = next(
                v for k, v in expected.items() if k[1] == key[1] and np.array_equal(
                    v[0], e.get_observations(0)) and (key[0] is None or k[0] == key[0]))
            assert np.array_equal(e.get_observations(1), next_obs)
            assert int(e.get_actions(0)) == action
            assert float(e.get_rewards(0)) == pytest.approx(ret)
            assert e.is_terminated == terminated
            assert e.extra_model_outputs["weights"][0] == pytest.approx(1.0)  # all priorities 1


def test_n_step_returns_are_rllib_discounted_sums(server) -> None:
    episodes = cartpole_episodes(seed=1)
    ours = buffer_on(server, table="nstep", n_step=3, gamma=GAMMA)
    ours.add(episodes)
    expected = transitions(episodes, n=3)
    sampled = ours.sample(num_items=200, n_step=3, gamma=GAMMA)
    assert {e.extra_model_outputs["n_step"][0] for e in sampled} >= {3}
    for e in sampled:
        key = next(k for k, v in expected.items() if k[1] == e.t_started and np.array_equal(
            v[0], e.get_observations(0)))
        obs, action, ret, next_obs, m, terminated = expected[key]
        assert e.extra_model_outputs["n_step"][0] == m
        assert float(e.get_rewards(0)) == pytest.approx(ret, rel=1e-6)
        assert np.array_equal(e.get_observations(1), next_obs)
        assert e.is_terminated == terminated


def _tree_rows(ref: PrioritizedEpisodeReplayBuffer) -> dict[tuple[int, int], int]:
    """(episode number, t) -> the row's node in RLlib's segment trees."""
    rows = {}
    for eps_idx, ts, node in ref._indices:
        episode = ref.episodes[eps_idx - ref._num_episodes_evicted]
        rows[(episode_number(episode.id_), episode.t_started + ts)] = node
    return rows


@pytest.mark.parametrize("prefetch", [2, 0], ids=["stream", "calls"])
def test_priorities_and_weights_after_updates_match_rllib_segment_tree(server, prefetch) -> None:
    """Both ways of drawing: a sample stream whose updates ride on its credits (the default),
    and a call per sample with a waiting call per update (``prefetch=0``)."""
    episodes = cartpole_episodes(seed=2)
    ours, ref = buffer_on(server, prefetch=prefetch), reference(episodes)
    ours.add(episodes)
    nodes = _tree_rows(ref)
    for round_ in range(3):
        sampled = ours.sample(num_items=32, beta=BETA)
        keys = [(episode_number(e.id_), e.t_started) for e in sampled]  # the added ids
        td = np.abs(np.sin(np.arange(32) + round_)) * 3  # TD errors, a few near 0
        ref._last_sampled_indices = [nodes[k] for k in keys]  # the same rows in RLlib's
        ref.update_priorities(td)
        ours.update_priorities(td)
    ours.flush()  # the stream's last updates applied (a no-op with prefetch=0)
    total, n = ref._sum_segment.sum(), ref.get_num_timesteps()
    max_weight = (ref._min_segment.min() / total * n) ** -BETA
    batch = ours.client.sample("rllib", 256)
    for row_id, key_episode, t, p, w in zip(batch.ids.tolist(),
                                           batch.columns["episode"].tolist(),
                                           batch.columns["t"].tolist(),
                                           batch.probabilities.tolist(), batch.weights.tolist()):
        want = ref._sum_segment[nodes[(key_episode, t)]] / total
        assert p == pytest.approx(want, rel=1e-6), row_id
        assert w == pytest.approx((want * n) ** -BETA / max_weight, rel=1e-5)


def test_metrics_are_rllib_metrics(server) -> None:
    episodes = cartpole_episodes(seed=3)
    ours, ref = buffer_on(server), reference([])
    ours.add(episodes)
    ref.add(episodes)
    ours.sample(num_items=16, beta=BETA)
    ref.sample(num_items=16, beta=BETA)
    mine, theirs = ours.get_metrics(), ref.get_metrics()
    assert set(mine) == set(theirs)
    for key in ("num_env_steps_sampled", "num_env_steps_added", "num_episodes_added"):
        assert mine[key] == theirs[key], key
    # the rows stored, estimated in add without a round trip (exact with one writer)
    assert mine["num_env_steps_stored"] == len(ours) == 300
    ours.update_priorities(np.ones(16))
    assert ours.get_metrics()["num_priorities_updated"] == 16


def test_what_it_cannot_do_is_refused_by_name_and_loses_nothing(server) -> None:
    ours = buffer_on(server)
    ours.add(cartpole_episodes(seed=4, steps=40))
    with pytest.raises(ValueError, match=r"n_step=\(1, 3\).*1-step returns"):
        ours.sample(num_items=8, n_step=(1, 3))
    with pytest.raises(ValueError, match="batch_length_T=20"):
        ours.sample(num_items=8, batch_length_T=20)
    with pytest.raises(ValueError, match=r"update_priorities: 3 priorities for the 0 rows"):
        ours.update_priorities(np.ones(3))
    ours.sample(num_items=8)
    with pytest.raises(ValueError, match=r"update_priorities: 7 priorities for the 8 rows"):
        ours.update_priorities(np.ones(7))
    with pytest.raises(TypeError, match="got MultiAgentEpisode .multi-agent: replay_server.ray.rllib_multi"):
        ours.add([*cartpole_episodes(seed=6, steps=20), MultiAgentEpisode()])
    assert len(ours) == 40  # nothing of a refused call was stored
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match=rf"prefetch must be an int >= 0.*got {bad}"):
            buffer_on(server, prefetch=bad)
        with pytest.raises(ConfigError, match=rf"pending_adds must be an int >= 0.*got {bad}"):
            buffer_on(server, pending_adds=bad)
    with pytest.raises(ConfigError, match="'flat' samples 'uniform'"):
        buffer_on(server, table="flat")
    with pytest.raises(ConfigError, match="no table 'absent'"):
        buffer_on(server, table="absent")


def _episode_of_another_env(steps: int) -> SingleAgentEpisode:
    """An episode whose observations have 3 values, where CartPole's have 4."""
    space = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)
    episode = SingleAgentEpisode(observation_space=space, action_space=gym.spaces.Discrete(2))
    episode.add_env_reset(np.zeros(3, np.float32), {})
    for t in range(steps):
        episode.add_env_step(np.full(3, t, np.float32), 0, 1.0, {},
                             terminated=t == steps - 1)
    return episode.to_numpy()


def test_a_failed_background_add_is_raised_by_the_next_call_and_loses_nothing_stored(
        server) -> None:
    """``add`` returns before its insert is stored (``pending_adds``): an insert the server
    refuses is raised by the next call, naming its rows; the rows stored before stay, and
    nothing queued after it is stored out of order."""
    ours = buffer_on(server)
    ours.add(cartpole_episodes(seed=7, steps=30))
    assert len(ours) == 30  # len waits for the adds on their way
    ours.add(_episode_of_another_env(10))  # returns: the server refuses it meanwhile
    with pytest.raises(WriterError, match=r"a background insert of 10 rows .*not stored") as err:
        ours.flush()
    assert "obs" in str(err.value.__cause__)  # the server's reason: the column that differs
    with pytest.raises(WriterError, match="10 rows"):  # and every later call says so
        ours.add(cartpole_episodes(seed=8, steps=20))
    assert ours.client.info()["rllib"].size == 30


def test_state_holds_checkpoint_paths_and_counters(server, tmp_path) -> None:
    ours = buffer_on(server)
    ours.add(cartpole_episodes(seed=5, steps=50))
    ours.sample(num_items=8)
    state = ours.get_state()
    assert [p for p in state["checkpoints"].values() if str(tmp_path) in p]
    again = buffer_on(server)
    again.set_state(state)
    assert again.get_num_episodes() == ours.get_num_episodes()
    assert again.get_added_timesteps() == 50 and again.get_sampled_timesteps() == 8
    with pytest.raises(ValueError, match="the state is of table 'rllib'.*this buffer's is 'nstep'"):
        buffer_on(server, table="nstep", n_step=3, gamma=GAMMA).set_state(state)


def test_what_it_keeps_of_episodes_is_bounded_by_the_rows_the_table_holds(server) -> None:
    """The episode ids a sampled row comes back with are kept only for the episodes among
    the last ``capacity`` rows added (a long run added millions of episodes, one entry
    each): the window stays bounded, every sampled row still carries its episode's RLlib
    id, and the count of episodes added is every one of them."""
    ours = ShardedEpisodeReplayBuffer(capacity=100, alpha=ALPHA, beta=BETA, table="small",
                                      address=server.address)
    added: list[SingleAgentEpisode] = []
    for seed in range(20):  # 1,200 steps, about 60 episodes, into 100 rows
        episodes = cartpole_episodes(seed=seed, steps=60)
        ours.add(episodes)
        added += episodes
    ids = {episode_number(e.id_): e.id_ for e in added if len(e)}  # (none stored of empty ones)
    assert ours.get_num_episodes() == len(ids) > 40
    window = ours.get_state()["episodes"]
    kept = window["episodes"]
    assert len(kept) < len(ids) / 3
    assert sum(rows for _, _, rows in kept[1:]) < 100 <= sum(rows for _, _, rows in kept)
    for episode in ours.sample(num_items=64, beta=BETA):
        number = episode_number(episode.id_)  # the id it came back with is RLlib's own
        assert ids[number] == episode.id_
    again = ShardedEpisodeReplayBuffer(capacity=100, alpha=ALPHA, beta=BETA, table="small",
                                       address=server.address)
    again.set_state(ours.get_state())
    assert again.get_num_episodes() == ours.get_num_episodes()
    assert again.get_state()["episodes"] == ours.get_state()["episodes"]
    # A state saved by an earlier build (every episode's id, no window) still loads.
    old = {k: v for k, v in ours.get_state().items() if k != "episodes"}
    old["episode_ids"] = sorted(ids.values())
    again.set_state(old)
    assert again.get_num_episodes() == len(ids)
    assert all(ids[episode_number(e.id_)] == e.id_ for e in again.sample(num_items=16))
