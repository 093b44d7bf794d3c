"""update_priorities(wait=False): ordered, merged, errors surfaced later, against a real server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from replay_client import ReplayClient, errors
from replay_client.updates import PriorityUpdater

from tests.conftest import module_server

CONFIG = """
[[tables]]
name = "per"
capacity = 1000
sampler = "prioritized"
alpha = 1.0
seed = 3

[[tables]]
name = "other"
capacity = 1000
sampler = "prioritized"
alpha = 1.0
"""


server = module_server(CONFIG)


def _probabilities(client: ReplayClient, table: str) -> dict[int, float]:
    batch = client.sample(table, 2000)
    return {int(i): float(p) for i, p in zip(batch.ids, batch.probabilities)}


def test_async_updates_apply_in_order_last_one_wins(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(4)}, priorities=torch.ones(4))
    for value in (5.0, 9.0, 2.0, 3.0):  # the last update of id 0 is 3.0
        assert client.update_priorities("per", ids[:1], torch.tensor([value]), wait=False) is None
    client.update_priorities("per", ids[1:2], torch.tensor([0.0]), wait=False)
    client.flush_updates()
    probabilities = _probabilities(client, "per")
    assert probabilities[int(ids[0])] == pytest.approx(3.0 / (3.0 + 0.0 + 1.0 + 1.0))
    assert int(ids[1]) not in probabilities


def test_a_waiting_update_comes_after_earlier_async_ones(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(2)}, priorities=torch.ones(2))
    for _ in range(50):
        client.update_priorities("per", ids, torch.tensor([7.0, 7.0]), wait=False)
    assert client.update_priorities("per", ids, torch.tensor([1.0, 3.0])) == 2
    probabilities = _probabilities(client, "per")
    assert probabilities[int(ids[1])] == pytest.approx(0.75)


def test_a_background_failure_is_raised_by_the_next_call_with_its_cause(server):
    client = ReplayClient(server.address)
    client.reset("per")
    ids = client.insert("per", {"x": torch.zeros(2)})
    never_issued = torch.tensor([int(ids[-1]) + 10**9])  # this id segment's, far ahead
    client.update_priorities("per", never_issued, torch.tensor([1.0]), wait=False)
    with pytest.raises(errors.PriorityUpdateError, match="1 ids were not applied") as raised:
        client.flush_updates()
    assert isinstance(raised.value.__cause__, errors.InvalidIdsError)
    client.update_priorities("per", ids[:1], torch.tensor([1.0]), wait=False)
    client.flush_updates()  # reported once; the updater goes on


def test_bad_priorities_are_refused_before_queueing(server):
    client = ReplayClient(server.address)
    with pytest.raises(errors.InvalidPriorityError, match="finite and >= 0"):
        client.update_priorities("per", torch.tensor([0]), torch.tensor([float("nan")]), wait=False)
    with pytest.raises(errors.InvalidIdsError, match="int64"):
        client.update_priorities("per", torch.tensor([0.0]), torch.tensor([1.0]), wait=False)


def test_updates_to_several_tables_interleave_correctly(server):
    client = ReplayClient(server.address)
    for table in ("per", "other"):
        client.reset(table)
    a = client.insert("per", {"x": torch.zeros(2)}, priorities=torch.ones(2))
    b = client.insert("other", {"x": torch.zeros(2)}, priorities=torch.ones(2))
    for value in (2.0, 4.0):
        client.update_priorities("per", a[:1], torch.tensor([value]), wait=False)
        client.update_priorities("other", b[:1], torch.tensor([value * 10]), wait=False)
    client.close()  # sends what is queued
    client = ReplayClient(server.address)
    assert _probabilities(client, "per")[int(a[0])] == pytest.approx(4.0 / 5.0)
    assert _probabilities(client, "other")[int(b[0])] == pytest.approx(40.0 / 41.0)


def test_queued_updates_to_one_table_are_merged_into_few_calls():
    calls = []
    release = __import__("threading").Event()

    def send(table, ids, priorities):
        release.wait(5)  # hold the first call so the rest pile up
        calls.append((table, ids.copy(), priorities.copy()))
        return ids.size

    updater = PriorityUpdater(send)
    for i in range(20):
        updater.submit("t", np.array([i], dtype=np.int64), np.array([float(i)]))
    release.set()
    updater.flush(timeout=10)
    updater.close()
    assert len(calls) <= 3
    assert np.concatenate([c[1] for c in calls]).tolist() == list(range(20))
    assert updater.applied == 20


def test_merged_updates_of_slices_keep_their_rows_and_others_go_flat():
    """Slices ``[B, L]`` stay rows when merged (a table that mixes priorities per slice takes
    whole slices); updates of other shapes merge flat, as before."""
    calls = []
    threading = __import__("threading")
    started, release = threading.Event(), threading.Event()

    def send(table, ids, priorities):
        started.set()
        release.wait(5)
        calls.append((table, ids.copy(), priorities.copy()))
        return ids.size

    updater = PriorityUpdater(send)
    updater.submit("first", np.zeros(1, dtype=np.int64), np.zeros(1))
    assert started.wait(5)  # the first call is held: the rest pile up behind it
    for i in range(3):
        rows = np.arange(4 * i, 4 * i + 4, dtype=np.int64).reshape(2, 2)
        updater.submit("slices", rows, rows.astype(np.float64))
    updater.submit("mixed", np.arange(2, dtype=np.int64), np.zeros(2))
    updater.submit("mixed", np.arange(2, 6, dtype=np.int64).reshape(2, 2), np.zeros((2, 2)))
    release.set()
    updater.flush(timeout=10)
    updater.close()
    sent = {table: ids for table, ids, _ in calls}
    assert sent["slices"].shape == (6, 2) and sent["slices"].reshape(-1).tolist() == list(range(12))
    assert sent["mixed"].shape == (6,) and sent["mixed"].tolist() == list(range(6))
