"""``for batch in rb``: each batch is the caller's to keep, pinned staging or not.

Batches are read from a stream whose staging buffers are reused; with pinning
on (an accelerator present), 6e15745 copied each batch into a reused pinned
buffer after its own clone, so batches kept by the loop changed under it. A
simulated accelerator (tests/feed/test_core.py) turns pinning on here.
"""

from __future__ import annotations

import itertools

import pytest

import replay_feed.delivery
from replay_client import RemoteReplayBuffer
from tests.client.remote_buffer.data import rows, trajectories
from tests.feed.test_core import SlowAccelerator


@pytest.mark.parametrize("shared_memory", ["0", "1"])
def test_batches_kept_from_iteration_do_not_change(client, fresh, monkeypatch,
                                                   shared_memory) -> None:
    monkeypatch.setattr(replay_feed.delivery, "detect_accelerator", SlowAccelerator)
    monkeypatch.setenv("REPLAY_SHARED_MEMORY", shared_memory)
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=16, prefetch=1)
    rb.extend(rows(100))
    kept, seen = [], []
    for batch in itertools.islice(rb, 8):
        kept.append(batch)
        seen.append(batch["x"].clone())
    assert all((b["x"] == s).all() for b, s in zip(kept, seen))
    assert len({tuple(s.tolist()) for s in seen}) > 1  # different batches, not one buffer


def test_iteration_counts_steps_on_slice_tables(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=8)
    rb.extend(trajectories(4, 10))
    for batch in itertools.islice(rb, 3):
        assert batch.batch_size == (8,)
        steps = batch["step"].reshape(2, 4)
        assert (steps[:, 1:] - steps[:, :-1] == 1).all()
