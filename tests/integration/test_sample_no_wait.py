"""``sample(wait=False)`` never waits, whatever holds the batch back: real server, real client.

Issue 24, friction 5: on a rate-limited table ``sample(wait=False)`` (and
``RemoteReplayBuffer(wait=False).sample()``) waited the call's whole deadline
(29.9 s) before ``DeadlineExceededError``, where docs/torchrl.md promises
``EmptyTableError`` at once. Each call here has a long timeout: a call that
waited would end in ``DeadlineExceededError``, not the error asserted.
The default (``wait=None``) keeps Reverb's flow control: a sample the rate
limiter holds back waits (tests/integration/test_rate_limiter.py).
"""

from __future__ import annotations

import pytest
import torch

from replay_client import RemoteReplayBuffer, ReplayClient, errors
from tests.conftest import module_server

CONFIG = """
[[tables]]
name = "below_min"
capacity = 100
min_size_to_sample = 10

[[tables]]
name = "ratio"
capacity = 100
min_size_to_sample = 1
samples_per_insert = 1.0
error_buffer = 2.0

[[tables]]
name = "empty"
capacity = 100
"""

LONG_S = 120  # a call that waited would take this long and end in DeadlineExceededError

server = module_server(CONFIG)


def _rows(n: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(n, dtype=torch.float32).unsqueeze(1)}


@pytest.fixture
def client(server):
    client = ReplayClient(server.address, timeout=LONG_S)
    yield client
    client.close()


def test_below_min_size_to_sample_raises_empty_table_at_once(client):
    client.insert("below_min", _rows(3))
    with pytest.raises(errors.EmptyTableError, match="min_size_to_sample|rate limiter"):
        client.sample("below_min", 2, wait=False)
    limiter = client.info()["below_min"].rate_limiter
    assert (limiter["samples"], limiter["blocked_samples"]) == (0, 0)


def test_held_back_by_the_ratio_raises_empty_table_at_once(client):
    client.insert("ratio", _rows(4))
    drawn = 0
    with pytest.raises(errors.EmptyTableError, match="rate limiter") as refused:
        for _ in range(20):  # the ratio allows a few rows past the inserts, then holds back
            drawn += client.sample("ratio", 1, wait=False).ids.numel()
    assert "wait=False" in str(refused.value)
    assert 0 < drawn < 20 and client.info()["ratio"].rate_limiter["samples"] == drawn


def test_an_empty_table_still_raises_empty_table_at_once(client):
    with pytest.raises(errors.EmptyTableError):
        client.sample("empty", 2, wait=False)
    with pytest.raises(errors.EmptyTableError):
        client.sample("empty", 2)  # the default: an empty table does not wait either


def test_remote_replay_buffer_with_wait_false_raises_at_once(client):
    client.insert("below_min", _rows(1))
    buffer = RemoteReplayBuffer(client, "below_min", batch_size=2, wait=False)
    with pytest.raises(errors.EmptyTableError, match="wait=False"):
        buffer.sample()
