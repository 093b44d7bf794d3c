"""n-step tables through a real server: Sample and SampleStream (gRPC and shared memory)
return the n-step columns, the bootstrap observation and the step counts."""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import module_server

server = module_server("""
[[tables]]
name = "nstep"
capacity = 1000
n_step = 3
gamma = 0.5
""")


def episode(number: int, length: int) -> dict:
    t = torch.arange(length)
    return {"obs": (number * 100 + t).unsqueeze(1).float(),
            "next": {"obs": (number * 100 + t + 1).unsqueeze(1).float()},
            "reward": torch.ones(length), "done": t == length - 1,
            "episode": torch.full((length,), number)}


def check(batch) -> None:
    t = batch.data["obs"][:, 0] % 100
    length = 5  # every episode: steps 0..4, done at 4
    steps = torch.clamp(length - t, max=3).long()
    assert torch.equal(batch.data["steps_to_next_obs"], steps)
    assert torch.equal(batch.data["next"]["obs"][:, 0], batch.data["obs"][:, 0] + steps)
    assert torch.allclose(batch.data["reward"], (1 - 0.5 ** steps.float()) / 0.5)
    assert torch.equal(batch.data["done"], t + steps == length)


@pytest.mark.parametrize("shared_memory", [False, True])
def test_sample_and_stream_return_n_step_transitions(server, shared_memory: bool) -> None:
    client = ReplayClient(server.address, timeout=30)
    for number in range(8):
        client.insert("nstep", episode(number, 5))
    check(client.sample("nstep", 64))
    for batch in client.stream("nstep", 32, num_batches=4, shared_memory=shared_memory):
        check(batch)
