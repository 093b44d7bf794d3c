"""A compiled training step that writes, samples and updates priorities through a server.

TorchRL's own ``test_extend_sample_recompile`` compiles ``rb.extend(data);
rb.sample()``; against a server it failed in Dynamo ("Guard failed on the
same frame it was created") or, with another backend, on the codec's NumPy
writes: the step never ran. The calls now break the graph and run as plain
Python (:mod:`replay_feed.eager`); the compiled step gives the eager result
and, once warm, compiles nothing again.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from replay_client import RemoteReplayBuffer
from tests.client.remote_buffer.data import rows

WARM_UP = 3  # as TorchRL's test: the first calls may compile the step's variants


@pytest.fixture
def no_recompiles():
    """After the warm-up, any recompilation raises."""
    return torch._dynamo.config.patch(error_on_recompile=True)


def test_extend_and_sample_in_a_compiled_function(client, fresh, no_recompiles) -> None:
    """TorchRL's test, as its users write it (plain tensors, the default backend)."""
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4, include_info=False)
    torch._dynamo.reset()

    @torch.compile
    def extend_and_sample(data: torch.Tensor) -> torch.Tensor:
        rb.extend(data)
        return rb.sample()

    data = torch.arange(15.0).reshape(5, 3)
    for _ in range(WARM_UP):
        extend_and_sample(data)
    with no_recompiles:
        for _ in range(4):
            batch = extend_and_sample(data)
    assert batch.shape == (4, 3)
    assert set(batch[:, 0].tolist()) <= {0.0, 3.0, 6.0, 9.0, 12.0}  # rows as written
    assert len(rb) == 10 and rb.write_count == 35


def test_a_prioritized_step_samples_learns_and_updates_in_one_compiled_function(
        client, fresh, no_recompiles) -> None:
    """The learner's step: sample, a loss on the batch, new priorities from it, all compiled;
    the priorities written reach the table (the row whose loss is largest dominates)."""
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=32, alpha=1.0, beta=0.4,
                            priority_key="td_error")
    rb.extend(rows(20))
    weights = torch.zeros(2)
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def step() -> torch.Tensor:
        batch = rb.sample()
        td_error = (batch["x"] == 3).float() * 1000 + 0.01  # row 3 has all the error
        loss = (batch["obs"] @ weights + td_error).mean()
        batch.set("td_error", td_error)
        rb.update_tensordict_priority(batch)
        return loss

    for _ in range(WARM_UP):
        step()
    with no_recompiles:
        for _ in range(3):
            step()
    share = (rb.sample(256)["x"] == 3).float().mean().item()
    assert share > 0.9  # 1000 / (1000 + 19 * 0.01) after the update: all but ~0.02%


def test_a_compiled_step_reads_the_client_directly(client, fresh) -> None:
    """Without the TorchRL buffer: ``ReplayClient.insert``, ``sample`` and
    ``update_priorities`` inside a compiled function."""
    table = fresh("per")
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def step(data: TensorDict) -> torch.Tensor:
        client.insert(table, data, priorities=torch.ones(data.shape[0]))
        batch = client.sample(table, 8)
        client.update_priorities(table, batch.ids, batch.data["obs"][:, 0] + 1)
        return batch.data["obs"].sum()

    total = step(rows(10))
    assert total.item() >= 0 and client.info()[table].size == 10
    client.flush_updates()
    assert client.info()[table].counters["priority_updates"] >= 1


def test_a_compiled_step_takes_its_batch_from_a_stream(client, fresh) -> None:
    """``next(stream)`` and ``stream.update_priorities`` inside the compiled step."""
    table = fresh("per")
    client.insert(table, rows(20))
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def step(stream) -> torch.Tensor:
        batch = next(stream)
        stream.update_priorities(batch.ids, (batch.data["x"] == 3).float() * 1000 + 0.01)
        return batch.data["obs"].sum()

    with client.stream(table, 64, num_batches=4) as stream:
        totals = [step(stream) for _ in range(4)]
    assert all(total.item() >= 0 for total in totals)
    assert client.info()[table].counters["priority_updates"] >= 1
