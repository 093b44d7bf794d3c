"""Priority updates over the client's message limit (issue 34, item 0), against a real server.

A learner that queues ``wait=False`` updates faster than the server answers
has them merged; merged (or single) updates over the 4 MiB message limit
used to be refused whole with ``MessageTooLargeError`` and every id in them
lost. They now go out as several requests under the limit: every id is
applied, which the tests read back id by id (``read(..., priorities=True)``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from replay_client import ReplayClient
from replay_client.update_parts import max_ids_per_message, update_parts
from replay_client.updates import PriorityUpdater

from tests.conftest import module_server

ROWS = 300_000
"""Rows of the table: one update of all their ids is 4.8 MB, over the 4 MiB limit."""

CONFIG = f"""
[[tables]]
name = "per"
capacity = {ROWS}
sampler = "prioritized"
alpha = 1.0

[[tables]]
name = "mixed"
capacity = 4000
sampler = "prioritized_slice"
slice_len = 11
priority_mixing = 0.5
"""

server = module_server(CONFIG)


@pytest.fixture(scope="module")
def stored(server) -> torch.Tensor:
    """The ids of ``ROWS`` rows of table ``per``."""
    with ReplayClient(server.address, timeout=120) as client:
        return client.insert("per", {"x": torch.zeros(ROWS)})


def _priorities(address: str, ids: torch.Tensor) -> np.ndarray:
    with ReplayClient(address, timeout=120) as client:
        read = client.read("per", ids=ids, columns=False, priorities=True)
    return read.priorities.numpy()


def test_one_waiting_update_over_the_message_limit_is_applied_whole(server, stored):
    values = 1.0 + np.arange(ROWS) % 1000
    with ReplayClient(server.address, timeout=120) as client:
        assert client.update_priorities("per", stored, values) == ROWS
    np.testing.assert_array_equal(_priorities(server.address, stored), values)


def test_queued_updates_merged_past_the_message_limit_are_all_applied(server, stored):
    """Twelve calls of 100,000 ids back to back (19 MB of ids, queued far faster than the
    server answers): the last round's priority of every id is what the table holds."""
    third = ROWS // 3
    rounds = 4
    with ReplayClient(server.address, timeout=120) as client:
        for r in range(rounds):
            for k in range(3):
                part = slice(k * third, (k + 1) * third)
                values = 10.0 * (r + 1) + np.arange(third) % 7
                assert client.update_priorities("per", stored[part], values, wait=False) is None
    # close() sent every queued update, raising any failure (none may be lost)
    expected = np.tile(10.0 * rounds + np.arange(third) % 7, 3)
    np.testing.assert_array_equal(_priorities(server.address, stored), expected)


def test_flat_slice_updates_over_the_limit_are_cut_between_whole_slices(server):
    """A table that mixes priorities per slice refuses a partial slice: flat ids over the
    limit are cut at multiples of its slice_len (11, which 241,920 ids per message is not)."""
    with ReplayClient(server.address, timeout=120) as client:
        client.reset("mixed")
        client.insert("mixed", {"x": torch.zeros(4000), "episode": torch.zeros(4000, dtype=torch.int64),
                                "done": torch.zeros(4000, dtype=torch.bool)})
        ids = client.sample("mixed", 25_000).ids  # 25,000 slices: 275,000 ids
        assert ids.shape == (25_000, 11)
        flat = ids.reshape(-1)
        assert client.update_priorities("mixed", flat, torch.full(flat.shape, 2.0)) == flat.numel()
        client.update_priorities("mixed", flat, torch.full(flat.shape, 3.0), wait=False)
        client.flush_updates()


def test_parts_keep_rows_whole_and_cut_flat_ids_at_the_step():
    ids = np.arange(60, dtype=np.int64)
    rows = [p[0].shape for p in update_parts(ids.reshape(12, 5), ids.reshape(12, 5), 23)]
    assert rows == [(4, 5), (4, 5), (4, 5)]
    flat = [p[0] for p in update_parts(ids, ids.astype(np.float64), 23, step=5)]
    assert [p.size for p in flat] == [20, 20, 20]
    assert np.concatenate(flat).tolist() == ids.tolist()
    assert [p[0].size for p in update_parts(ids, ids, 4, step=7)] == [7] * 8 + [4]
    assert max_ids_per_message(4 << 20) * 16 < (4 << 20) - 64 * 1024


def test_the_updater_merges_no_more_than_a_message_and_sends_large_ones_in_parts():
    calls = []
    release = __import__("threading").Event()

    def send(table, ids, priorities):
        release.wait(5)  # hold the first call so the rest pile up
        calls.append(ids.copy())
        return ids.size

    updater = PriorityUpdater(send, max_ids_per_call=10,
                              parts=lambda t, i, p: update_parts(i, p, 10))
    for i in range(8):
        updater.submit("t", np.arange(4 * i, 4 * i + 4, dtype=np.int64), np.zeros(4))
    updater.submit("t", np.arange(32, 57, dtype=np.int64), np.zeros(25))
    release.set()
    updater.flush(timeout=10)
    updater.close()
    assert all(c.size <= 10 for c in calls)
    assert np.concatenate(calls).tolist() == list(range(57))
    assert updater.applied == 57
