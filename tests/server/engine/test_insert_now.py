"""``Table.insert_now``: an insert the service's event loop may make, or ``None`` with nothing
stored.

It stores at once only where that is quick: the table's storage allocated, every column
plain host memory, its lock free this instant. Everywhere else (a first insert that
allocates, memmap or compressed columns, a held lock, a table logging its changes) it
returns ``None`` having changed nothing, and the caller makes the ordinary insert. A rate
limiter's refusal is raised as by ``insert``, with nothing stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replay_server import Table, TableConfig
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.checkpoint.wal.logged_table import LoggedTable
from replay_server.engine.incarnations import LocalIncarnations
from replay_server.engine.table_set import TableSet
from replay_server.errors import RateLimitedError
from tests.server.engine.held import lock_held_elsewhere


def _rows(n: int, start: float = 0.0) -> dict:
    return {"x": torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)}


def test_it_stores_like_insert_once_the_storage_is_there() -> None:
    table = Table(TableConfig(name="t", capacity=100, sampler="prioritized", seed=0))
    assert table.insert_now(_rows(2)) is None  # the first insert allocates: not on a loop
    assert table.info().size == 0
    assert table.insert(_rows(2)).tolist() == [0, 1]
    assert table.insert_now(_rows(3, 2.0), torch.tensor([1.0, 2.0, 3.0])).tolist() == [2, 3, 4]
    read = table.read_rows(ids=torch.arange(5))
    assert read.columns["x"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert table.info().counters.inserted == 5


def test_a_held_lock_means_none_and_nothing_stored() -> None:
    table = Table(TableConfig(name="t", capacity=100, sampler="uniform", seed=0))
    table.insert(_rows(1))
    with lock_held_elsewhere(table):
        assert table.insert_now(_rows(4)) is None
    assert table.info().size == 1
    assert table.insert_now(_rows(4)).tolist() == [1, 2, 3, 4]  # ids were not taken


@pytest.mark.parametrize("options", ["memmap", "compressed"])
def test_columns_on_disk_or_compressed_are_never_written_this_way(tmp_path: Path,
                                                                  options: str) -> None:
    extra = ({"storage": "memmap", "storage_dir": str(tmp_path)} if options == "memmap"
             else {"compress_keys": ["x"]})
    table = Table(TableConfig(name="t", capacity=100, sampler="uniform", seed=0, **extra))
    table.insert(_rows(2))
    assert table.insert_now(_rows(2)) is None
    assert table.info().size == 2


def test_a_rate_limited_insert_raises_as_insert_does_and_stores_nothing() -> None:
    table = Table(TableConfig(name="t", capacity=100, sampler="uniform", seed=0,
                              min_size_to_sample=2, samples_per_insert=1.0, error_buffer=1.0))
    table.insert(_rows(3))  # filling up is free; the count is at its top now
    with pytest.raises(RateLimitedError):
        table.insert_now(_rows(1))
    assert table.info().size == 3


def test_a_table_that_logs_its_changes_is_never_written_this_way(tmp_path: Path) -> None:
    config = TableConfig(name="t", capacity=100, sampler="uniform", seed=0)
    tables = TableSet([config], LocalIncarnations(0, 1), make_table=LoggedTable)
    table = tables["t"]
    table.insert(_rows(2))
    assert table.insert_now(_rows(1)) is not None  # no log attached yet: as a plain table
    log = WriteAheadLog(tmp_path, shard=0, incarnation=1, first_index=0, sync="os",
                        max_bytes=1 << 20)
    try:
        table.attach(log)
        assert table.insert_now(_rows(1)) is None  # the log's sync may block
        assert table.info().size == 3
    finally:
        table.attach(None)
        log.close()
