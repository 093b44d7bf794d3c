"""Rows read and overwritten by storage position (engine/row_access) on every storage and
reader: plain, frame-stacked (stacks rebuilt on read) and compressed (rows encoded on write)."""

from __future__ import annotations

import pytest
import torch

from replay_server import Table, TableConfig
from replay_server.engine.ids import IdRing
from replay_server.errors import InvalidArgumentError

from tests.server.engine.test_table_reset import _stacked_episode


def test_a_frame_stacked_table_reads_rows_with_their_stacks_rebuilt():
    table = Table(TableConfig(name="f", capacity=8, frame_stack_key="obs"))
    episode = _stacked_episode(5, 3, (2,))
    table.insert(episode)
    found = table.read_rows(positions=[0, 3, 4])
    assert torch.equal(found.columns["obs"], episode["obs"][[0, 3, 4]])
    assert torch.equal(found.columns["next.obs"], episode["next"]["obs"][[0, 3, 4]])


def test_an_n_step_table_reads_rows_not_transitions():
    table = Table(TableConfig(name="n", capacity=8, n_step=2, gamma=0.5))
    x = torch.arange(4.0)
    rows = {"x": x, "next": {"x": x + 1}, "reward": torch.ones(4),
            "episode": torch.zeros(4, dtype=torch.int64),
            "done": torch.zeros(4, dtype=torch.bool)}
    table.insert(rows)
    found = table.read_rows(positions=[1, 2])
    assert torch.equal(found.columns["reward"], torch.ones(2))  # not the 2-step return 1.5
    assert torch.equal(found.columns["next.x"], x[[1, 2]] + 1)
    with pytest.raises(InvalidArgumentError, match="n_step"):
        table.write_rows([1], {k: v[:1] if torch.is_tensor(v) else {"x": v["x"][:1]}
                                for k, v in rows.items()})


def test_a_compressed_table_overwrites_rows_in_place():
    table = Table(TableConfig(name="c", capacity=8, compress_keys=("obs",)))
    obs = torch.arange(6 * 16, dtype=torch.uint8).reshape(6, 16)
    table.insert({"obs": obs})
    new = torch.full((2, 16), 7, dtype=torch.uint8)
    table.write_rows([4, 1], {"obs": new})
    found = table.read_rows(positions=list(range(6)))
    expected = obs.clone()
    expected[[4, 1]] = new
    assert torch.equal(found.columns["obs"], expected)


def test_a_refused_write_changes_nothing():
    table = Table(TableConfig(name="r", capacity=4))
    table.insert({"x": torch.arange(3.0)})
    with pytest.raises(InvalidArgumentError, match="holds no row"):
        table.write_rows([0, 3], {"x": torch.tensor([9.0, 9.0])})
    assert torch.equal(table.read_rows(positions=[0, 1, 2]).columns["x"], torch.arange(3.0))


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "slice"])
def test_a_reset_table_saves_only_the_rows_written_since(sampler):
    """3f9a6b4 started positions over after a reset by moving the ids to a multiple of the
    capacity, and 'slots written' became the whole capacity: a checkpoint of a reset table
    saved every slot, dead rows and never-written memory included."""
    extra = {"slice": {"slice_len": 2, "done_key": "done"}}.get(sampler, {})
    config = TableConfig(name="r", capacity=100, sampler=sampler, **extra)
    table = Table(config)
    rows = {"x": torch.arange(5.0), "done": torch.zeros(5, dtype=torch.bool),
            "episode": torch.zeros(5, dtype=torch.int64)}
    table.insert(rows)
    table.reset()
    table.insert({k: v[:3] for k, v in rows.items()})
    state = table.state_dict()
    assert state["columns"]["x"].shape[0] == 3
    assert table.read_rows(positions=[0, 1, 2]).columns["x"].tolist() == [0.0, 1.0, 2.0]
    restored = Table(config)
    restored.load_state_dict(state)
    assert restored.info().size == 3
    assert restored.read_rows(positions=[2]).columns["x"].tolist() == [2.0]


def test_id_counters_saved_before_the_reset_base_load_as_written_from_zero():
    """Checkpoints written before IdRing.base existed have no 'base': their resets never
    moved the ids, so every slot below next_id (up to the capacity) was written."""
    ring = IdRing(10)
    ring.load_state_dict({"next_id": 7, "first_live": 7})  # an old checkpoint, after a reset
    assert (ring.base, ring.used) == (0, 7)
    ring.clear()
    assert (ring.next_id, ring.base, ring.used) == (10, 10, 0)
    with pytest.raises(ValueError, match="inconsistent id counters"):
        ring.load_state_dict({"next_id": 12, "first_live": 12, "base": 5})
