"""The learner: double DQN with prioritized replay and importance weights, one batch at a time.

Batches come from ``client.stream`` (prefetched in the background); each
update weights the Huber TD loss by the batch's importance weights, sends
``|td error|`` back as the rows' new priorities (``wait=False``: queued,
merged and sent in the background), softly tracks a target network, and
every ``publish_every`` updates publishes the online network's weights for
the actors.
"""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from examples.dqn_cartpole.model import GAMMA, act, q_network
from replay_client import ReplayClient, SampleBatch


class Learner:
    """Double DQN over a prioritized table.

    Args:
        client: the server's client.
        lr: Adam's learning rate.
        tau: soft target-network update rate per step.
        publish_every: updates between weight publishes.
    """

    def __init__(self, client: ReplayClient, *, lr: float = 5e-4, tau: float = 0.005,
                 publish_every: int = 25) -> None:
        self.client = client
        self.net = q_network()
        self.target = copy.deepcopy(self.net)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=lr)
        self.tau = tau
        self.publish_every = publish_every
        self.updates = 0
        self.version = self.publish()

    def publish(self) -> int:
        """Publish the online network's weights (tensors only); returns the version."""
        self.version = self.client.publish("policy", self.net.state_dict())
        return self.version

    def update(self, batch: SampleBatch) -> float:
        """One gradient step on ``batch``; returns the loss."""
        data = batch.data
        obs, next_obs = data["obs"], data["next"]["obs"]
        action = data["action"].long().unsqueeze(1)
        reward, terminated = data["reward"], data["done"].float()  # the table's n-step sums
        discount = GAMMA ** data["steps_to_next_obs"].float()  # gamma ** m, m <= n steps
        q = self.net(obs).gather(1, action).squeeze(1)
        with torch.no_grad():
            best = self.net(next_obs).argmax(dim=1, keepdim=True)
            next_q = self.target(next_obs).gather(1, best).squeeze(1)
            target = reward + discount * (1.0 - terminated) * next_q
        td = target - q
        loss = (batch.weights * nn.functional.smooth_l1_loss(q, target, reduction="none")).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.net.parameters(), 10.0)
        self.optimizer.step()
        with torch.no_grad():
            for p, tp in zip(self.net.parameters(), self.target.parameters()):
                tp.lerp_(p, self.tau)
        self.client.update_priorities("replay", batch.ids, td.detach().abs() + 1e-3, wait=False)
        self.updates += 1
        if self.updates % self.publish_every == 0:
            self.publish()
        return float(loss.detach())


@torch.no_grad()
def evaluate(net: nn.Module, episodes: int = 20, seed: int = 12345) -> float:
    """Mean return of ``episodes`` greedy CartPole-v1 episodes (stepped together)."""
    envs = [gym.make("CartPole-v1") for _ in range(episodes)]
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
    returns = np.zeros(episodes)
    running = np.ones(episodes, dtype=bool)
    generator = torch.Generator().manual_seed(seed)
    while running.any():
        actions = act(net, torch.from_numpy(obs).float(), 0.0, generator).numpy()
        for i in np.flatnonzero(running):
            obs[i], reward, terminated, truncated, _ = envs[i].step(int(actions[i]))
            returns[i] += reward
            running[i] = not (terminated or truncated)
    return float(returns.mean())
