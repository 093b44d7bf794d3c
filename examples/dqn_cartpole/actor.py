"""An actor process: a CartPole-v1 vector env, the newest published policy, steps through a
vector writer.

Each actor steps ``envs`` environments at once (a Gymnasium ``SyncVectorEnv``,
which resets an ended sub-env on the step after its end: ``next_step``
autoreset) with one forward pass of its own copy of the Q-network, into which
it loads the learner's newest weights (``client.fetch("policy",
newer_than=version, timeout=0)``: only tensors travel, no pickled module).
Each vector step goes through ``client.vector_writer`` as ``[envs]`` rows
(obs, action, reward, next.obs, done = terminated, truncated): the writer
gives each sub-env's episodes their own ids and drops the reset steps, and
the table turns the steps into 3-step transitions (``n_step = 3``), never
across an episode's end. The writer batches rows and sends them in the
background. A ``samples_per_insert`` rate limiter on the table keeps actors
from running ahead of the learner: the writer's inserts wait on the server
when they would.
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
        vec = gym.make_vec("CartPole-v1", num_envs=envs, vectorization_mode="sync")
        obs, _ = vec.reset(seed=seed * 1000)
        returns = np.zeros(envs)
        resetting = np.zeros(envs, dtype=bool)  # next_step autoreset: this step only resets
        with client.vector_writer("replay", env=vec, next_obs_key="next.obs", batch_rows=64,
                                  max_pending_rows=256, max_delay_s=0.05) as writer:
            tick = 0
            while not stop.is_set():
                epsilon = max(0.02, 1.0 - 0.98 * steps / epsilon_steps)
                actions = act(net, torch.from_numpy(obs).float(), epsilon, generator).numpy()
                next_obs, reward, terminated, truncated, info = vec.step(actions)
                writer.append({"obs": obs.astype(np.float32), "action": actions,
                               "reward": reward.astype(np.float32),
                               "next": {"obs": next_obs.astype(np.float32)},
                               "done": terminated, "truncated": truncated}, info)
                returns += np.where(resetting, 0.0, reward)
                ended = terminated | truncated
                for i in np.flatnonzero(ended).tolist():
                    report.put(("episode", index, steps + i + 1, float(returns[i])))
                    returns[i] = 0.0
                resetting = ended
                obs = next_obs
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
