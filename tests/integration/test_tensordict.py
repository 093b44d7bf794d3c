"""TensorDicts through a real server: [n_envs, T] collector batches in, slices that keep each
env's episodes apart, and TensorDicts with TorchRL's index/_weight out of sample and streams."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from replay_client import ReplayClient, SampleBatch
from tests.conftest import module_server

E, T, L = 4, 25, 5

CONFIG = f"""
[[tables]]
name = "seq"
capacity = 10000
sampler = "slice"
slice_len = {L}
done_key = "next.done"
seed = 1

[[tables]]
name = "per"
capacity = 1000
sampler = "prioritized"
seed = 2
"""

served = module_server(CONFIG)


def collector_batch(round_: int) -> TensorDict:
    """TorchRL-collector-like: nested keys, [E, T, 1] flags; env e ends an episode every 6 + e steps."""
    t = torch.arange(T)[None, :].expand(E, T)
    env = torch.arange(E)[:, None].expand(E, T)
    step = 10_000 * round_ + 100 * env + t
    done = ((round_ * T + t) % (6 + env) == 5 + env)[..., None]
    return TensorDict({
        "observation": step[..., None].float().expand(E, T, 3).clone(),
        "step": step, "env": env, "done": torch.zeros(E, T, 1, dtype=torch.bool),
        "next": {"done": done, "reward": torch.ones(E, T, 1), "observation": torch.zeros(E, T, 3)},
    }, batch_size=[E, T])


@pytest.fixture(scope="module")
def client(served) -> ReplayClient:
    client = ReplayClient(served.address)
    for round_ in range(3):
        assert client.insert("seq", collector_batch(round_)).shape == (E * T,)
    ids = client.insert("per", TensorDict({"obs": {"x": torch.arange(40.0)[:, None]}}, [40]))
    client.update_priorities("per", ids, torch.arange(40.0) + 1)
    return client


def check_slices(td: TensorDict) -> None:
    step, env = td["step"], td["env"]
    assert (env == env[:, :1]).all(), "a slice mixes envs"
    assert (step[:, 1:] - step[:, :-1] == 1).all(), "a slice is not consecutive steps"
    assert not td["next", "done"][:, :-1].any(), "a slice runs past the end of an episode"
    assert (td["episode"] == td["episode"][:, :1]).all()


def test_collector_batches_are_stored_as_envs_times_steps_rows(client) -> None:
    info = client.info()["seq"]
    assert info.size == 3 * E * T
    assert info.schema["observation"] == "float32[3]" and info.schema["next.done"] == "bool[1]"
    assert info.schema["episode"] == "int64[]"


def test_sampled_slices_keep_envs_and_episodes_apart(client) -> None:
    td = client.sample("seq", 256).to_tensordict()
    assert td.batch_size == (256, L)
    assert td["observation"].shape == (256, L, 3) and td["next", "reward"].shape == (256, L, 1)
    assert td["index"].shape == (256, L) and td["_weight"].shape == (256, L)
    check_slices(td)


def test_prioritized_sample_as_tensordict_carries_index_and_weights(client) -> None:
    batch = client.sample("per", 64)
    td = batch.to_tensordict()
    assert torch.equal(td["index"], batch.ids) and td["index"].dtype == torch.int64
    assert torch.equal(td["_weight"], batch.weights) and td["_weight"].dtype == torch.float32
    assert td["_weight"].max() <= 1.0 and td["_weight"].unique().numel() > 1  # priorities differ
    assert td["obs", "x"].shape == (64, 1)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared_memory", "grpc"])
def test_streams_deliver_tensordicts_with_index_and_weight(client, shared_memory) -> None:
    stream = client.stream("seq", 32, num_batches=4, transform=SampleBatch.to_tensordict,
                           shared_memory=shared_memory, batches_per_message=1)
    count = 0
    for td in stream:
        assert isinstance(td, TensorDict) and td.batch_size == (32, L)
        assert td["index"].dtype == torch.int64 and torch.equal(td["_weight"], torch.ones(32, L))
        check_slices(td)
        count += 1
    assert count == 4
    assert stream.transport == ("shared_memory" if shared_memory else "grpc")
