"""A SampleStream's leases on a queue table: the books of groups drawn, finished and given back."""

from __future__ import annotations

import pytest
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.table import Table
from replay_server.errors import InvalidArgumentError
from replay_server.service.stream_leases import MAX_PREFIX, StreamLeases

BATCH = 2


def queue(rows: int = 20, sampler: str = "fifo") -> Table:
    table = Table(TableConfig(name="q", capacity=100, sampler=sampler))
    table.insert({"x": torch.arange(rows)})
    return table


def draw(table: Table, leases: StreamLeases, index: int, batches: int) -> list[int]:
    """What the stream's draw does in the engine pool."""
    leases.settle()
    lease = leases.request(index)
    rows = table.sample(BATCH * batches, lease=lease).data["x"].tolist()
    leases.drawn(lease, batches)
    return rows


def rest(table: Table) -> list[int]:
    return table.sample(table.size).data["x"].tolist() if table.size else []


def test_only_leased_on_tables_whose_rows_leave_and_with_a_prefix() -> None:
    assert StreamLeases.open(queue(), "", BATCH) is None
    uniform = Table(TableConfig(name="u", capacity=10, sampler="uniform"))
    assert StreamLeases.open(uniform, "p", BATCH) is None
    assert StreamLeases.open(queue(), "p", BATCH) is not None
    with pytest.raises(InvalidArgumentError, match="lease prefix"):
        StreamLeases.open(queue(), "x" * (MAX_PREFIX + 1), BATCH)


def test_groups_finished_whole_are_acknowledged_and_the_rest_come_back_at_the_end() -> None:
    table = queue()
    leases = StreamLeases.open(table, "p", BATCH)
    assert leases is not None
    first = draw(table, leases, 0, 2)    # batches 0, 1
    second = draw(table, leases, 2, 2)   # batches 2, 3
    draw(table, leases, 4, 1)            # batch 4
    leases.finish(3)                     # 0, 1 and 2: the first group whole, the second in part
    assert not leases.all_finished
    assert leases.end() == 2 + 2         # batch 3 and batch 4 come back
    got = rest(table)
    assert got[:4] == second[BATCH:] + [8, 9]  # back at the front, in their order (fifo)
    assert not set(got) & set(first + second[:BATCH])
    assert sorted(first + second[:BATCH] + got) == list(range(20))


def test_a_draw_that_ends_after_the_stream_gives_its_lease_back() -> None:
    table = queue()
    leases = StreamLeases.open(table, "p", BATCH)
    assert leases is not None
    assert leases.end() == 0
    draw(table, leases, 0, 1)
    assert table.size == 20 and table.info().counters.returned == BATCH


def test_finishing_more_than_was_drawn_is_refused() -> None:
    table = queue()
    leases = StreamLeases.open(table, "p", BATCH)
    assert leases is not None
    draw(table, leases, 0, 1)
    with pytest.raises(InvalidArgumentError, match="finished"):
        leases.finish(2)
    with pytest.raises(InvalidArgumentError):
        leases.finish(-1)
    leases.finish(1)
    assert leases.all_finished and leases.end() == 0 and table.size == 20 - BATCH
