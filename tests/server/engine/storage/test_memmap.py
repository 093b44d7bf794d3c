"""Memory-mapped tables: the same batches as an in-RAM table, checks at start, RAM not counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.memory import MemoryLedger
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage.memmap import MemmapColumn
from replay_server.engine.table import Table
from replay_server.errors import ConfigError

SCHEMA = {"obs": FieldSpec(torch.uint8, (4, 6)), "reward": FieldSpec(torch.float32, ()),
          "episode": FieldSpec(torch.int64, ())}


def pair(tmp_path: Path, **fields) -> tuple[Table, Table]:
    """The same table twice: in RAM and memory-mapped under ``tmp_path``."""
    common = {"name": "t", "capacity": 50, "seed": 7, **fields}
    return (Table(TableConfig(**common)),
            Table(TableConfig(**common, storage="memmap", storage_dir=str(tmp_path))))


def rows(first: int, n: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(first)
    return {"obs": torch.randint(0, 255, (n, 4, 6), dtype=torch.uint8, generator=generator),
            "reward": torch.randn(n, generator=generator),
            "episode": torch.arange(first, first + n) // 7}


def same(a, b) -> None:
    assert torch.equal(a.ids, b.ids)
    assert a.data.keys() == b.data.keys()
    for key in a.data:
        assert torch.equal(a.data[key], b.data[key]), key


@pytest.mark.parametrize("sampler, extra", [("uniform", {}), ("prioritized", {}),
                                            ("slice", {"slice_len": 3}), ("fifo", {})])
@pytest.mark.parametrize("sorted_gathers", [False, True])
def test_batches_equal_the_in_ram_tables_across_wrap_around_and_a_reload(
        tmp_path: Path, sampler: str, extra: dict, sorted_gathers: bool) -> None:
    ram, mapped = pair(tmp_path, sampler=sampler, **extra)
    for first in range(0, 120, 30):  # 120 rows into 50 slots: the ring wraps twice
        for table in (ram, mapped):
            table.insert(rows(first, 30))
        for column in mapped._parts.storage.columns.values():  # force the path under test
            column.sorted_gathers = sorted_gathers
        same(ram.sample(12), mapped.sample(12))
    reloaded = Table(mapped.config)
    reloaded.load_state_dict(mapped.state_dict())
    for column in reloaded._parts.storage.columns.values():
        column.sorted_gathers = sorted_gathers
    same(ram.sample(12), reloaded.sample(12))
    assert os.listdir(tmp_path) == []  # files are unlinked once mapped: nothing left behind


def test_a_missing_or_unwritable_directory_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="storage_dir .*nope' does not exist"):
        Table(TableConfig(name="t", capacity=10, storage="memmap",
                          storage_dir=str(tmp_path / "nope")))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        Table(TableConfig(name="t", capacity=10, storage="memmap",
                          storage_dir=str(tmp_path / "file")))


def test_a_disk_too_small_is_refused_at_start_with_the_bytes(tmp_path: Path) -> None:
    config = TableConfig(name="t", capacity=2**40, storage="memmap", storage_dir=str(tmp_path),
                         schema={"obs": FieldSpec(torch.uint8, (1024,))})
    with pytest.raises(ConfigError, match=r"needs 1024\.0 TiB on disk .* free"):
        Table(config)
    assert os.listdir(tmp_path) == []


def test_ram_budget_counts_the_sampler_not_the_rows_on_disk(tmp_path: Path) -> None:
    schema = {"obs": FieldSpec(torch.uint8, (1024,))}  # 1 MiB of rows at capacity 1024
    ledger = MemoryLedger(limit=512 << 10)
    with pytest.raises(ConfigError, match="more than"):
        Table(TableConfig(name="ram", capacity=1024, schema=schema), memory=MemoryLedger(512 << 10))
    table = Table(TableConfig(name="disk", capacity=1024, schema=schema, storage="memmap",
                              storage_dir=str(tmp_path)), memory=ledger)
    assert ledger.committed == 0 and table.info().storage_bytes == 1 << 20
    storage = table._parts.storage
    assert all(isinstance(c, MemmapColumn) for c in storage.columns.values())
    assert storage._prefaulter is None  # never pulled in


@pytest.mark.parametrize("fields, named", [
    ({"storage": "memmap"}, "needs storage_dir"),
    ({"storage": "disk", "storage_dir": "/tmp"}, "storage must be one of memory, memmap"),
    ({"storage_dir": "/tmp"}, "only used by storage 'memmap'"),
    ({"storage": "memmap", "storage_dir": "/tmp", "pin_memory": True}, "pin_memory has no meaning"),
])
def test_bad_storage_options_are_refused_naming_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TableConfig(name="t", capacity=8, **fields)


def test_a_range_larger_than_the_free_space_is_refused_before_any_block_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a disk file system, posix_fallocate takes blocks until the disk is full before it
    # fails: every other writer on that disk would see ENOSPC meanwhile.
    from replay_server.engine.storage.memmap import MappedFile
    from replay_server.errors import InsufficientMemoryError

    reserved: list[int] = []
    real_fallocate = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        reserved.append(length)
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    file = MappedFile(tmp_path, "t.obs", 2 * free, "t", reserve=False)
    with pytest.raises(InsufficientMemoryError, match="ran out of space reserving"):
        file.reserve(0, 2 * free)
    assert reserved == []
    file.reserve(0, 4096)  # a range that fits is reserved, and again (already held)
    file.reserve(0, 4096)
    assert reserved == [4096, 4096]
