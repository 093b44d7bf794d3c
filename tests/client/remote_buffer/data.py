"""Data as TorchRL scripts write it, for the RemoteReplayBuffer tests."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def trajectories(count: int, length: int, start: int = 0, *, done: bool = True) -> TensorDict:
    """``count`` trajectories of ``length`` steps, flat ``[count * length]`` (a collector's
    output reshaped to 1-D): ``step`` numbers every step from ``start``, ``traj`` names its
    trajectory, ``("next", "done")`` marks each last step (unless ``done=False``)."""
    n = count * length
    step = torch.arange(start, start + n)
    ends = (torch.arange(n) % length == length - 1)[:, None]
    data = {"step": step, "traj": step // length,
            "obs": step.float()[:, None].expand(n, 3).clone(),
            "next": {"done": ends & done, "reward": torch.ones(n, 1)}}
    return TensorDict(data, batch_size=[n])


def rows(n: int, start: int = 0) -> TensorDict:
    x = torch.arange(start, start + n)
    return TensorDict({"x": x, "obs": x.float()[:, None].expand(n, 2).clone()}, batch_size=[n])
