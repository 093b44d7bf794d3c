"""Saving and restoring a buffer continues its sample stream, as TorchRL's does (its tests
test_rng_state_dict, test_rng_dumps, test_replay_buffer_prefetch_*_roundtrip; issue 32)."""

from __future__ import annotations

import pytest
import torch

from replay_client import RemoteReplayBuffer
from tests.client.remote_buffer.data import rows


def _draws(rb: RemoteReplayBuffer, count: int = 4) -> list[list[int]]:
    return [rb.sample()["x"].tolist() for _ in range(count)]


def _filled(client, table: str, prioritized: bool) -> RemoteReplayBuffer:
    rb = RemoteReplayBuffer(client, table, batch_size=8, prefetch=3)
    n = 50 if prioritized else 6
    rb.extend(rows(n))
    if prioritized:
        rb.update_priority(torch.arange(n), torch.arange(n) + 1.0)
    rb.sample()
    return rb


@pytest.mark.parametrize("kind", ["per", "rows"])
def test_state_dict_round_trip_continues_the_sample_stream(client, fresh, kind) -> None:
    rb = _filled(client, fresh(kind), kind == "per")
    state = rb.state_dict()
    after_save = _draws(rb)
    rb.load_state_dict(state)
    assert _draws(rb) == after_save
    other = RemoteReplayBuffer(client, fresh(kind), batch_size=8)  # another learner's table
    other.load_state_dict(state)
    assert _draws(other) == after_save
    assert _draws(rb) != after_save  # the stream goes on, it does not repeat


@pytest.mark.parametrize("kind", ["per", "rows"])
def test_dumps_round_trip_continues_the_sample_stream(client, fresh, kind, tmp_path) -> None:
    rb = _filled(client, fresh(kind), kind == "per")
    rb.dumps(tmp_path / "rb")
    after_save = _draws(rb)
    rb.loads(tmp_path / "rb")
    assert _draws(rb) == after_save


def test_a_seeded_buffer_saves_the_same_seeds_again(client, fresh) -> None:
    """A run seeded through generator= saves seeds derived from it: a rerun of the same
    script draws the same batches after its save too."""
    seen = []
    for _ in range(2):
        rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=8,
                                generator=torch.Generator().manual_seed(7))
        rb.extend(rows(6))
        rb.state_dict()
        seen.append(_draws(rb))
    assert seen[0] == seen[1]


def test_a_pickled_buffer_samples_with_its_clients_timeout(client, fresh) -> None:
    """TorchRL sends buffers to other processes by pickling them. The timeout default (the
    client's own) came back from pickle as another object, taken for a number: the copy's
    first sample raised TypeError (TorchRL's test_replay_buffer_prefetch_pickle_roundtrip)."""
    import pickle

    from replay_client.connection import CLIENT_TIMEOUT

    assert pickle.loads(pickle.dumps(CLIENT_TIMEOUT)) is CLIENT_TIMEOUT
    rb = _filled(client, fresh("rows"), prioritized=False)
    copy = pickle.loads(pickle.dumps(rb))
    assert copy.timeout is CLIENT_TIMEOUT
    assert set(copy.sample()["x"].reshape(-1).tolist()) <= set(range(6))
    with_timeout = pickle.loads(pickle.dumps(RemoteReplayBuffer(client, rb.table, timeout=7.5)))
    assert with_timeout.timeout == 7.5 and len(with_timeout.sample(4)) == 4
