"""VectorWriter: a real Gymnasium SyncVectorEnv (CartPole) through each autoreset mode into
slice, n-step and plain tables of a real server: one episode per sub-env, no reset step
stored, the true last observation of each episode (issue 32)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from replay_client import ReplayClient, errors
from replay_client.vector_writer import VectorWriter, normal_mode
from tests.conftest import module_server

ENVS, STEPS, MAX_STEPS = 4, 90, 12
MODES = {"next_step": AutoresetMode.NEXT_STEP, "same_step": AutoresetMode.SAME_STEP,
         "disabled": AutoresetMode.DISABLED}

server = module_server("".join(
    f'[[tables]]\nname = "slices_{mode}"\ncapacity = 10000\nsampler = "slice"\nslice_len = 2\n\n'
    f'[[tables]]\nname = "nstep_{mode}"\ncapacity = 10000\nn_step = 3\ngamma = 0.5\n\n'
    f'[[tables]]\nname = "rows_{mode}"\ncapacity = 10000\nsampler = "uniform"\n\n'
    for mode in MODES))


def _envs(mode: str) -> SyncVectorEnv:
    return SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=MAX_STEPS)
                          for _ in range(ENVS)], autoreset_mode=MODES[mode])


def _run(client: ReplayClient, mode: str) -> tuple[list[list[tuple]], int, list[VectorWriter]]:
    """Step the env, write every step through three vector writers, and keep the reference:
    each sub-env's episodes as lists of (obs, next_obs, terminated) - what happened."""
    envs = _envs(mode)
    writers = [client.vector_writer(f"slices_{mode}", env=envs, next_obs_key="next.obs"),
               client.vector_writer(f"nstep_{mode}", env=envs, next_obs_key="next.obs"),
               client.vector_writer(f"rows_{mode}", ENVS, autoreset_mode=MODES[mode],
                                    next_obs_key="next.obs")]
    episodes: list[list[list[tuple]]] = [[[]] for _ in range(ENVS)]
    resets = 0
    rng = np.random.default_rng(0)
    obs, _ = envs.reset(seed=0)
    resetting = np.zeros(ENVS, dtype=bool)
    for _ in range(STEPS):
        action = rng.integers(0, 2, size=ENVS)
        next_obs, reward, terminated, truncated, info = envs.step(action)
        step = {"obs": obs, "action": action, "reward": reward, "next": {"obs": next_obs},
                "done": terminated, "truncated": truncated}
        for writer in writers:
            writer.append(step, info)
        ends = terminated | truncated
        for i in range(ENVS):
            if mode == "next_step" and resetting[i]:
                resets += 1
                continue
            last = info["final_obs"][i] if mode == "same_step" and ends[i] else next_obs[i]
            episodes[i][-1].append((obs[i].tolist(), np.asarray(last).tolist(),
                                    bool(terminated[i])))
            if ends[i]:
                episodes[i].append([])
        resetting = ends
        if mode == "disabled" and ends.any():
            fresh, _ = envs.reset(options={"reset_mask": ends})
            next_obs = np.where(ends[:, None], fresh, next_obs)
        obs = next_obs
    for writer in writers:
        writer.close()
    return [e for per_env in episodes for e in per_env if e], resets, writers


def _stored_episodes(client: ReplayClient, table: str) -> list[list[tuple]]:
    size = client.info()[table].size
    got = client.read(table, positions=np.arange(size))
    order = np.argsort(np.asarray(got.ids))
    cols = {k: v[torch.from_numpy(order)] for k, v in got.columns.items()}
    by_episode: dict[int, list[tuple]] = {}
    for k in range(size):
        by_episode.setdefault(int(cols["episode"][k]), []).append(
            (cols["obs"][k].tolist(), cols["next.obs"][k].tolist(), bool(cols["done"][k])))
    return list(by_episode.values())


@pytest.mark.parametrize("mode", list(MODES))
def test_each_sub_env_episode_is_stored_whole_without_reset_steps(server, mode) -> None:
    client = ReplayClient(server.address, timeout=30)
    reference, resets, writers = _run(client, mode)
    assert sum(e[-1][2] for e in reference) > 3  # episodes ended, by termination too
    assert any(len(e) == MAX_STEPS for e in reference)  # and by truncation
    stored = _stored_episodes(client, f"slices_{mode}")
    assert sorted(stored) == sorted(reference)
    transitions = sum(len(e) for e in reference)
    assert client.info()[f"rows_{mode}"].size == transitions  # no episode column needed there
    assert writers[0].rows_dropped == resets and (resets > 0) == (mode == "next_step")
    _check_n_step(client, f"nstep_{mode}", reference)
    client.close()


def _check_n_step(client: ReplayClient, table: str, reference: list[list[tuple]]) -> None:
    """Every sampled n-step transition stays in one true episode: its bootstrap observation
    is the episode's step t + m - 1, never a reset step's or another episode's."""
    where = {tuple(step[0]): (e, k) for e, episode in enumerate(reference)
             for k, step in enumerate(episode)}
    batch = client.sample(table, 128)
    for obs, next_obs, done, m in zip(batch.data["obs"].tolist(),
                                      batch.data["next"]["obs"].tolist(),
                                      batch.data["done"].tolist(),
                                      batch.data["steps_to_next_obs"].tolist()):
        e, k = where[tuple(obs)]
        episode = reference[e]
        expected = min(3, len(episode) - k)
        assert m == expected
        assert next_obs == episode[k + m - 1][1] and done == episode[k + m - 1][2]


def test_same_step_needs_the_info_with_the_last_observations(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    envs = _envs("same_step")
    envs.reset(seed=1)
    with client.vector_writer("rows_same_step", env=envs, next_obs_key="next.obs") as writer:
        ended = np.array([False, True, False, False])
        step = {"obs": np.zeros((ENVS, 4), np.float32), "next": {"obs": np.ones((ENVS, 4),
                np.float32)}, "done": ended, "truncated": np.zeros(ENVS, bool)}
        with pytest.raises(errors.InvalidArgumentError, match="pass append"):
            writer.append(step)
    client.close()


def test_modes_and_shapes_are_checked() -> None:
    assert [normal_mode(m) for m in MODES.values()] == list(MODES)
    assert normal_mode("NextStep") == "next_step" and normal_mode("SAME_STEP") == "same_step"
    with pytest.raises(errors.InvalidArgumentError, match="autoreset_mode must be one of"):
        normal_mode("sometimes")
    envs = _envs("disabled")
    with pytest.raises(errors.InvalidArgumentError, match="declares"):
        VectorWriter(None, env=envs, autoreset_mode="next_step")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="num_envs=3 but the env has 4"):
        VectorWriter(None, 3, env=envs)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="needs num_envs"):
        VectorWriter(None)  # type: ignore[arg-type]
