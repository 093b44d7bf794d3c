"""The Q-network and the greedy / epsilon-greedy policy the actors and the learner share, and
the n-step return's settings the table and the learner share."""

from __future__ import annotations

import torch
from torch import nn

OBS_DIM = 4
ACTIONS = 2
N_STEP = 3
"""Steps summed into one transition's return by the table (n-step returns learn CartPole far
faster)."""
GAMMA = 0.99


def q_network() -> nn.Module:
    """A small MLP: 4 observations -> 2 action values."""
    return nn.Sequential(nn.Linear(OBS_DIM, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, ACTIONS))


@torch.no_grad()
def act(net: nn.Module, obs: torch.Tensor, epsilon: float, generator: torch.Generator
        ) -> torch.Tensor:
    """Epsilon-greedy actions for a batch of observations ``[n, 4]`` -> int64 ``[n]``."""
    greedy = net(obs).argmax(dim=1)
    explore = torch.rand(obs.shape[0], generator=generator) < epsilon
    random = torch.randint(ACTIONS, (obs.shape[0],), generator=generator)
    return torch.where(explore, random, greedy)
