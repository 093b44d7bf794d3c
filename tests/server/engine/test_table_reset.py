"""``Table.reset``: rows go, ids keep counting; ``schema=True`` also forgets the schema."""

from __future__ import annotations

import pytest
import torch

from replay_server import Table, TableConfig
from replay_server.engine.schema import FieldSpec
from replay_server.errors import SchemaMismatchError


def _rows(n: int, **columns: torch.Tensor) -> dict[str, torch.Tensor]:
    return columns or {"obs": torch.randn(n, 3), "reward": torch.randn(n)}


def test_reset_keeps_the_schema_and_the_refusal_names_the_way_out():
    table = Table(TableConfig(name="t", capacity=10))
    table.insert(_rows(4))
    table.reset()
    assert table.size == 0 and table.schema is not None
    with pytest.raises(SchemaMismatchError) as refused:
        table.insert({"observation": torch.randn(2, 3)})
    message = str(refused.value)
    assert "missing keys ['obs', 'reward']" in message
    assert "client.reset('t', schema=True)" in message
    assert "replay-server reset t --schema" in message


def test_reset_with_schema_lets_the_next_insert_fix_a_new_one():
    table = Table(TableConfig(name="t", capacity=10))
    old = table.insert(_rows(4))
    table.reset(schema=True)
    assert table.schema is None and table.size == 0 and table.info().storage_bytes == 0
    new = table.insert({"observation": torch.ones(3, 5, dtype=torch.uint8)})
    assert int(new.min()) > int(old.max())  # ids keep counting: the old ones stay stale
    assert dict(table.schema) == {"observation": FieldSpec(torch.uint8, (5,))}
    batch = table.sample(2)
    assert batch.data["observation"].shape == (2, 5) and (batch.data["observation"] == 1).all()
    assert table.info().counters.resets == 1


def test_reset_with_schema_keeps_a_schema_the_config_declares():
    declared = {"obs": FieldSpec(torch.float32, (3,))}
    table = Table(TableConfig(name="d", capacity=10, schema=declared))
    table.insert({"obs": torch.randn(2, 3)})
    table.reset(schema=True)
    assert dict(table.schema) == declared and table.size == 0
    with pytest.raises(SchemaMismatchError, match="declared in the config"):
        table.insert({"observation": torch.randn(2, 3)})
    table.insert({"obs": torch.randn(1, 3)})
    assert table.size == 1


def _stacked_episode(steps: int, stack: int, shape: tuple[int, ...]) -> dict:
    """One episode's rows with ``obs`` stacking ``stack`` frames (the first repeated at the
    start) and ``next.obs`` the stack one step later."""
    frames = [torch.full(shape, float(t + 1)) for t in range(steps + 1)]

    def stack_at(t: int) -> torch.Tensor:
        return torch.stack([frames[max(0, i)] for i in range(t - stack + 1, t + 1)])

    return {"obs": torch.stack([stack_at(t) for t in range(steps)]),
            "next": {"obs": torch.stack([stack_at(t + 1) for t in range(steps)])},
            "episode": torch.zeros(steps, dtype=torch.int64),
            "done": torch.arange(steps) == steps - 1}


def test_reset_with_schema_of_a_frame_stacked_table_rebuilds_its_stacks():
    table = Table(TableConfig(name="f", capacity=16, frame_stack_key="obs"))
    table.insert(_stacked_episode(3, 2, (4,)))
    table.reset(schema=True)
    table.insert(_stacked_episode(5, 3, (2, 2)))
    batch = table.sample(4)
    assert batch.data["obs"].shape == (4, 3, 2, 2)
    assert torch.equal(batch.data["next"]["obs"][:, :-1], batch.data["obs"][:, 1:])
