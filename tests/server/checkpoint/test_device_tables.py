"""Checkpoints of device tables, on the CPU stand-in (the device storage's own code path).

A device table's columns go to the checkpoint's files in pieces of at most
``chunk_bytes`` (each one device-to-host copy of those rows, never the whole
table on the host at once) in the normal format, and a restore writes them
back to the device piece by piece. The format is the host tables' own, so a
checkpoint of a device table restores into a host table and the other way
round. The GPU version of this test is in ``tests/gpu/test_device_table.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from replay_server import TableConfig, TableSet
from replay_server.checkpoint import load_checkpoint, write_checkpoint
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage import device as device_storage
from replay_server.engine.storage.placement import cpu_stand_in
from tests.server.checkpoint.test_writer_reader import _rows, assert_restored_state
from tests.server.engine.test_table_errors import assert_same_draw


def _configs(device: str) -> list[TableConfig]:
    return [TableConfig(name="prioritized", capacity=40, sampler="prioritized", seed=2,
                        device=device),
            TableConfig(name="slice", capacity=60, sampler="slice", slice_len=3, seed=3,
                        device=device),
            TableConfig(name="empty", capacity=10, device=device)]


def _filled(device: str) -> TableSet:
    tables = TableSet(_configs(device))
    for table in tables:
        if table.name == "empty":
            continue
        for start in range(0, 130, 13):  # wraps the ring: the saved rows start mid-column
            ids = table.insert(_rows(start, 13))
            if table.config.sampler.is_prioritized:
                table.update_priorities(ids, torch.rand(13) + 0.01)
        table.sample(5)
    return tables


@pytest.mark.parametrize("saved, restored", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_a_device_table_checkpoint_restores_exactly(directory, saved, restored) -> None:
    with cpu_stand_in():
        tables = _filled(saved)
        result = write_checkpoint(tables, directory, keep_latest=3, server_version="test",
                                  chunk_bytes=200)
        fresh = TableSet(_configs(restored))
        load_checkpoint(result.path, fresh)
        for table in tables:
            got = fresh[table.name]
            if restored == "cuda" and got.size:
                assert all(isinstance(c, device_storage.DeviceColumn)
                           for c in got._parts.storage.columns.values())
            got_state, saved_state = got.state_dict(), table.state_dict()
            assert (got_state["config"].pop("device"), saved_state["config"].pop("device")) == (
                restored, saved)  # the one difference: where the rows live
            assert_restored_state(got_state, saved_state)
            if table.size:
                assert_same_draw(got.sample(7), table.sample(7))


def test_device_rows_cross_to_the_host_in_bounded_pieces(directory, monkeypatch) -> None:
    """Saving and restoring never copies more than ``chunk_bytes`` of a column at once."""
    sliced: list[int] = []
    read = device_storage.DeviceColumn.__getitem__
    written = device_storage.DeviceColumn.__setitem__

    def counting_read(self, index):
        rows = read(self, index)
        sliced.append(rows.nbytes)
        return rows

    def counting_write(self, index, rows):
        sliced.append(rows.nbytes)
        written(self, index, rows)

    monkeypatch.setattr(device_storage.DeviceColumn, "__getitem__", counting_read)
    monkeypatch.setattr(device_storage.DeviceColumn, "__setitem__", counting_write)
    monkeypatch.setattr("replay_server.checkpoint.reader.DEFAULT_CHUNK_BYTES", 200)
    with cpu_stand_in():
        tables = _filled("cuda")
        result = write_checkpoint(tables, directory, keep_latest=3, server_version="test",
                                  chunk_bytes=200)
        saved_pieces = len(sliced)
        load_checkpoint(result.path, TableSet(_configs("cuda")))
    assert saved_pieces > 10 and len(sliced) - saved_pieces > 10  # read back in pieces too
    assert max(sliced) <= 200  # no piece of a column larger than the chunk


def test_a_restore_at_start_takes_the_device_memory_of_one_table(directory) -> None:
    """A server makes its tables, then fresh ones to restore into: only the restored rows
    take device memory, so a table of most of the device's memory restores."""
    schema = {"obs": FieldSpec(torch.uint8, (32, 32))}
    config = [TableConfig(name="big", capacity=500, device="cuda", schema=schema, seed=1)]
    nbytes = 500 * 32 * 32
    with cpu_stand_in(free_bytes=nbytes * 3 // 2) as machine:
        tables = TableSet(config)
        tables["big"].insert({"obs": torch.ones(400, 32, 32, dtype=torch.uint8)})
        result = write_checkpoint(tables, directory, keep_latest=3, server_version="test")
        del tables
        gc.collect()  # the table sits in reference cycles: collect it now
        assert machine.allocated == 0
        serving = TableSet(config)  # the server's tables before its restore
        restored = TableSet(config)  # what the restore loads into
        load_checkpoint(result.path, restored)
        assert machine.allocated == nbytes and restored["big"].size == 400
        assert torch.equal(restored["big"].sample(4).columns["obs"], torch.ones(4, 32, 32,
                                                                               dtype=torch.uint8))
        assert serving["big"].size == 0
