"""An actor process: CartPole-v1 envs, the newest published policy, transitions through a Writer.

Each actor steps ``envs`` environments at once with one forward pass of its
own copy of the Q-network, into which it loads the learner's newest weights
(``client.fetch("policy", newer_than=version, timeout=0)``: only tensors
travel, no pickled module). Each step of each env is one row (obs, action,
reward, next_obs, terminated) appended through a Writer (as n-step transitions,
see :class:`NStep`); the writer batches
rows and sends them in the background. A ``samples_per_insert`` rate limiter
on the table keeps actors from running ahead of the learner: the writer's
inserts wait on the server when they would.
"""

from __future__ import annotations

import multiprocessing
import time

import gymnasium as gym
import numpy as np
import torch

from examples.dqn_cartpole.model import act, q_network
from replay_client import ReplayClient

FETCH_EVERY_STEPS = 50
"""Env steps (per env) between checks for newer weights."""

N_STEP = 3
"""Steps summed into one transition's return (n-step returns learn CartPole far faster)."""

GAMMA = 0.99


class NStep:
    """An env's last ``N_STEP`` steps, turned into n-step transitions.

    A row is ``(obs, action, reward = sum_k gamma^k r_k, next_obs, terminated, discount)``:
    the learner's target is ``reward + discount * (1 - terminated) * Q(next_obs)``.
    """

    def __init__(self) -> None:
        self.steps: list[tuple[np.ndarray, int, float]] = []

    def push(self, obs: np.ndarray, action: int, reward: float) -> None:
        self.steps.append((obs, action, reward))

    def pop(self, next_obs: np.ndarray, terminated: bool, final: bool) -> list[dict]:
        """Rows ready now: one when ``N_STEP`` steps are held, all of them when the episode ended."""
        rows = []
        while self.steps and (final or len(self.steps) >= N_STEP):
            ret = sum(GAMMA ** k * r for k, (_, _, r) in enumerate(self.steps))
            obs, action, _ = self.steps.pop(0)
            rows.append({"obs": obs.astype(np.float32), "action": action,
                         "reward": float(ret), "next_obs": next_obs.astype(np.float32),
                         "terminated": bool(terminated),
                         "discount": float(GAMMA ** (len(self.steps) + 1))})
        return rows


def run_actor(index: int, address: str, report: multiprocessing.Queue, stop: multiprocessing.Event,
              *, envs: int, epsilon_steps: int, seed: int) -> None:
    """Act until ``stop`` is set; report ``("ready", index, 0, version)`` once the first
    weights are loaded, ``("episode", index, env_steps, return)`` per episode and, at the
    end, ``("actor_done", index, env_steps, versions_loaded, error)``."""
    torch.set_num_threads(1)
    client = ReplayClient(address, timeout=60)  # inserts may wait for the rate limiter
    net = q_network()
    versions: list[int] = []
    generator = torch.Generator().manual_seed(seed)
    steps = 0
    error = ""
    try:
        policy = client.fetch("policy", newer_than=0, timeout=120)  # the learner's first weights
        if policy is None:
            raise TimeoutError("no policy was published within 120 s")
        net.load_state_dict(policy)
        versions.append(policy.version)
        report.put(("ready", index, 0, policy.version))
        vec = [gym.make("CartPole-v1") for _ in range(envs)]
        obs = np.stack([env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(vec)])
        returns = np.zeros(envs)
        windows = [NStep() for _ in range(envs)]
        with client.writer("replay", batch_rows=64, max_pending_rows=256, max_delay_s=0.05,
                           episode_key=None) as writer:
            tick = 0
            while not stop.is_set():
                epsilon = max(0.02, 1.0 - 0.98 * steps / epsilon_steps)
                actions = act(net, torch.from_numpy(obs).float(), epsilon, generator).numpy()
                for i, env in enumerate(vec):
                    next_obs, reward, terminated, truncated, _ = env.step(int(actions[i]))
                    windows[i].push(obs[i].copy(), int(actions[i]), float(reward))
                    for row in windows[i].pop(next_obs, terminated, terminated or truncated):
                        writer.append(row)
                    returns[i] += reward
                    if terminated or truncated:
                        report.put(("episode", index, steps + i + 1, float(returns[i])))
                        returns[i] = 0.0
                        next_obs, _ = env.reset()
                    obs[i] = next_obs
                steps += envs
                tick += 1
                if tick % FETCH_EVERY_STEPS == 0:
                    newer = client.fetch("policy", newer_than=versions[-1], timeout=0)
                    if newer is not None:
                        net.load_state_dict(newer)
                        versions.append(newer.version)
                    report.put(("steps", index, steps, 0.0))
    except Exception as exc:  # reported to the demo, which fails loudly
        if not stop.is_set():  # once stopping, the server going away is expected
            error = f"{type(exc).__name__}: {exc}"
    finally:
        report.put(("actor_done", index, steps, versions, error))
        time.sleep(0.1)  # let the queue's feeder thread flush
