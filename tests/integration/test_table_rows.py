"""Rows by position or id (Read, Write), run-time exponents (SetExponents) and ids the server
never issued, through a real server and the real client."""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import module_server

CONFIG = """
[[tables]]
name = "rows"
capacity = 8

[[tables]]
name = "per"
capacity = 100
sampler = "prioritized"
alpha = 0.5
beta = 0.4
seed = 1

[[tables]]
name = "seq"
capacity = 100
sampler = "slice"
slice_len = 2
"""

served = module_server(CONFIG)


@pytest.fixture
def client(served) -> ReplayClient:
    client = ReplayClient(served.address)
    for table in ("rows", "per", "seq"):
        client.reset(table)
    return client


def rows(start: int, n: int) -> dict:
    x = torch.arange(start, start + n)
    return {"x": x.float()[:, None], "step": x}


def test_read_by_position_follows_storage_slots_and_wraps(client) -> None:
    client.insert("rows", rows(0, 6))
    got = client.read("rows", positions=[0, 5, 2])
    assert got.columns["step"].tolist() == [0, 5, 2] and got.size == 6
    client.insert("rows", rows(6, 4))  # wraps: positions 0 and 1 now hold steps 8 and 9
    assert client.read("rows", positions=torch.arange(8)).columns["step"].tolist() == [
        8, 9, 2, 3, 4, 5, 6, 7]


def test_positions_start_over_after_a_reset(client) -> None:
    client.insert("rows", rows(0, 5))
    client.reset("rows")
    ids = client.insert("rows", rows(100, 3))
    got = client.read("rows", positions=[0, 1, 2])
    assert got.columns["step"].tolist() == [100, 101, 102]
    assert torch.equal(got.ids, ids)


def test_read_by_id_and_refusals_name_what_is_wrong(client) -> None:
    ids = client.insert("rows", rows(0, 4))
    assert client.read("rows", ids=ids[[3, 1]]).columns["step"].tolist() == [3, 1]
    with pytest.raises(errors.InvalidArgumentError, match="position 6 holds no row"):
        client.read("rows", positions=[1, 6])
    with pytest.raises(errors.InvalidArgumentError, match="outside 0..7"):
        client.read("rows", positions=[8])
    client.insert("rows", rows(4, 8))  # overwrites every row of the first insert
    with pytest.raises(errors.InvalidIdsError, match="names no stored row"):
        client.read("rows", ids=ids[:1])


def test_write_replaces_rows_in_place_and_resets_their_priority(client) -> None:
    ids = client.insert("per", rows(0, 4), priorities=torch.tensor([1.0, 1.0, 1.0, 8.0]))
    client.update_priorities("per", ids[:1], torch.tensor([0.01]))
    client.write("per", [0], rows(50, 1))
    got = client.read("per", positions=[0, 3], priorities=True)
    assert got.columns["step"].tolist() == [50, 3]
    assert torch.equal(got.ids, ids[[0, 3]])  # a row written in place keeps its id
    assert got.priorities.tolist() == pytest.approx([8.0, 8.0])  # a new row's: the largest seen
    with pytest.raises(errors.SchemaMismatchError):
        client.write("per", [1], {"x": torch.zeros(1, 1)})
    assert client.read("per", positions=[1]).columns["step"].tolist() == [1]  # nothing changed


def test_write_is_refused_where_rows_are_linked(client) -> None:
    client.insert("seq", {**rows(0, 4), "episode": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(errors.InvalidArgumentError, match="episodes"):
        client.write("seq", [0], {**rows(9, 1), "episode": torch.zeros(1, dtype=torch.int64)})


def test_exponents_change_at_run_time_and_info_reports_them(client) -> None:
    ids = client.insert("per", rows(0, 2), priorities=torch.tensor([1.0, 9.0]))
    assert client.set_sampling("per", beta=1.0) == (0.5, 1.0)
    assert client.info()["per"].beta == 1.0
    before = client.sample("per", 2000)
    hot = (before.data["step"] == 1).float().mean().item()
    assert hot == pytest.approx(3 / 4, abs=0.05)  # 9 ** 0.5 : 1 ** 0.5
    assert client.set_sampling("per", alpha=1.0) == (1.0, 1.0)
    after = client.sample("per", 2000)
    assert (after.data["step"] == 1).float().mean().item() == pytest.approx(0.9, abs=0.04)
    assert client.read("per", ids=ids, priorities=True).priorities.tolist() == pytest.approx(
        [1.0, 9.0], rel=1e-5)  # priorities kept their meaning
    with pytest.raises(errors.NoPrioritiesError):
        client.set_sampling("rows", beta=0.5)
    with pytest.raises(errors.InvalidArgumentError, match="finite number"):
        client.set_sampling("per", alpha=-1.0)


def test_ids_never_issued_are_refused_not_ignored(client) -> None:
    """Storage positions passed as ids (TorchRL's index) were silently ignored as stale."""
    client.insert("per", rows(0, 4))
    with pytest.raises(errors.InvalidIdsError, match="never issued"):
        client.update_priorities("per", torch.arange(4), torch.ones(4))
    assert client.info()["per"].counters["stale_priority_updates"] == 0


def test_a_seed_makes_draws_repeat(client) -> None:
    client.insert("rows", rows(0, 8))
    client.set_sampling("rows", seed=7)
    first = client.sample("rows", 16).data["step"]
    client.set_sampling("rows", seed=7)
    assert torch.equal(client.sample("rows", 16).data["step"], first)
    assert client.set_sampling("rows", seed=8) == (0.0, 0.0)  # a table without priorities


def test_small_alphas_are_taken_and_priorities_update_under_them(client) -> None:
    """An alpha below ~0.125 made the priority bound overflow (an internal error)."""
    ids = client.insert("per", rows(0, 3))
    assert client.set_sampling("per", alpha=0.05)[0] == pytest.approx(0.05)
    assert client.update_priorities("per", ids, torch.tensor([1.0, 2.0, 1e30])) == 3
    client.set_sampling("per", alpha=0.5)
