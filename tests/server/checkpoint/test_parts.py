"""One bad part never costs a checkpoint the others; damaged and special files are damage.

Issue 23, finding 1: one variable no checkpoint could encode made every
checkpoint fail, the shutdown one included. A part (a table, the variables)
that fails for a reason of its own is now left out and named, the rest is
written, and a restore takes the missing part from an older checkpoint.
Finding 10: a damaged checkpoint was pruned on the second restart (no
longer looked at, so no longer known damaged), and a FIFO in place of a
column file hung the restore. Real files throughout.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from replay_server import TableConfig, TableSet
from replay_server.checkpoint import CheckpointDirectory, write_checkpoint
from replay_server.checkpoint import writer as writer_module
from replay_server.checkpoint.directory import DAMAGED_NAME
from replay_server.checkpoint.reader import read_manifest, restore_latest
from replay_server.engine.variables import VariableStore
from replay_server.errors import RestoreError

CONFIGS = [TableConfig(name="a", capacity=100), TableConfig(name="b", capacity=100)]
WAIT_S = 20


def tables_with(rows: int) -> TableSet:
    tables = TableSet(CONFIGS)
    for table in tables:
        table.insert({"x": torch.arange(float(rows))})
    return tables


def store_with(value: float) -> VariableStore:
    store = VariableStore(1 << 20)
    store.publish("policy", {"w": torch.full((3,), value)})
    return store


class BrokenStore(VariableStore):
    """Variables whose state cannot be saved (what a bad publish used to cause)."""

    def variables(self):
        raise ValueError("number of dimensions must be within [0, 64]")


def restore(directory: CheckpointDirectory):
    return restore_latest(directory, lambda: TableSet(CONFIGS),
                          make_variables=lambda: VariableStore(1 << 20))


def test_variables_that_cannot_be_saved_leave_the_tables_written(directory) -> None:
    write_checkpoint(tables_with(5), directory, keep_latest=3, server_version="t",
                     variables=store_with(1.0))
    broken = BrokenStore(1 << 20)
    broken.publish("policy", {"w": torch.full((3,), 2.0)})
    result = write_checkpoint(tables_with(7), directory, keep_latest=3, server_version="t",
                              variables=broken)
    assert [(p.kind, p.name) for p in result.failed] == [("variables", "")]
    assert "number of dimensions" in result.failed[0].error
    assert result.tables == {"a": 7, "b": 7} and not result.lost_tables
    manifest = read_manifest(result.path)
    assert manifest.variables is None and manifest.failed == result.failed
    tables, restored = restore(directory)
    assert restored.path == result.path
    assert tables["a"].size == 7 and tables["b"].size == 7  # the newest rows
    policy = restored.variables.get("policy")  # the variables of the checkpoint before
    assert policy.version == 1 and (policy.tensors["w"] == 1.0).all()


def test_a_table_that_cannot_be_saved_leaves_the_others_written(directory, monkeypatch) -> None:
    write_checkpoint(tables_with(5), directory, keep_latest=3, server_version="t")
    real = writer_module._write_table

    def failing(root, table, chunk_bytes, current):
        if table.name == "b":
            raise TypeError("a state value no checkpoint can hold")
        return real(root, table, chunk_bytes, current)

    monkeypatch.setattr(writer_module, "_write_table", failing)
    result = write_checkpoint(tables_with(9), directory, keep_latest=3, server_version="t",
                              variables=store_with(3.0))
    assert [(p.kind, p.name) for p in result.failed] == [("table", "b")]
    assert result.lost_tables and result.tables == {"a": 9}
    assert not (result.path / "b").exists()
    tables, restored = restore(directory)
    assert tables["a"].size == 9 and tables["b"].size == 5  # b from the older checkpoint
    assert restored.variables.get("policy").version == 1


def test_a_missing_part_no_older_checkpoint_holds_starts_empty(directory, caplog) -> None:
    result = write_checkpoint(tables_with(4), directory, keep_latest=3, server_version="t",
                              variables=BrokenStore(1 << 20))
    assert result.failed
    tables, restored = restore(directory)
    assert tables["a"].size == 4 and restored.variables.names() == []
    assert "no older checkpoint holds it" in caplog.text


def test_partial_checkpoints_never_push_out_the_last_complete_one(directory) -> None:
    complete = write_checkpoint(tables_with(1), directory, keep_latest=1, server_version="t",
                                variables=store_with(1.0))
    first = write_checkpoint(tables_with(2), directory, keep_latest=1, server_version="t",
                             variables=BrokenStore(1 << 20))
    second = write_checkpoint(tables_with(3), directory, keep_latest=1, server_version="t",
                              variables=BrokenStore(1 << 20))
    names = [ref.path for ref in directory.complete()]
    assert names == [complete.path, second.path]  # first: superseded by second
    assert first.path in second.removed
    latest = write_checkpoint(tables_with(4), directory, keep_latest=1, server_version="t",
                              variables=store_with(2.0))
    assert [ref.path for ref in directory.complete()] == [latest.path]


def test_a_checkpoint_found_damaged_is_kept_across_restarts(tmp_path: Path) -> None:
    def open_directory() -> CheckpointDirectory:
        directory = CheckpointDirectory(tmp_path / "ckpt")
        directory.open()
        return directory

    directory = open_directory()
    for rows in (1, 2):
        write_checkpoint(tables_with(rows), directory, keep_latest=2, server_version="t")
    damaged = directory.complete()[-1].path
    (damaged / "a" / "column-0.bin").write_bytes(b"")
    directory.close()

    directory = open_directory()  # first restart: finds it damaged, restores the older one
    tables, result = restore(directory)
    assert result.skipped[0][0] == damaged and (damaged / DAMAGED_NAME).exists()
    assert "truncated" in (damaged / DAMAGED_NAME).read_text()
    for rows in (3, 4):
        write_checkpoint(tables_with(rows), directory, keep_latest=1, server_version="t")
    directory.close()

    directory = open_directory()  # second restart: restores the newest, never reads the damaged
    tables, result = restore(directory)
    assert not result.skipped and tables["a"].size == 4
    write_checkpoint(tables_with(5), directory, keep_latest=1, server_version="t")
    assert damaged in [ref.path for ref in directory.complete()]
    directory.close()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_special_file_in_place_of_a_column_is_damage_refused_unread(directory, kind) -> None:
    older = write_checkpoint(tables_with(3), directory, keep_latest=3, server_version="t")
    newer = write_checkpoint(tables_with(6), directory, keep_latest=3, server_version="t")
    column = newer.path / "a" / "column-0.bin"
    column.unlink()
    if kind == "fifo":
        os.mkfifo(column)
    else:
        column.mkdir()
    done: list = []
    thread = threading.Thread(target=lambda: done.append(restore(directory)), daemon=True)
    thread.start()
    thread.join(WAIT_S)  # a FIFO opened for reading would wait for a writer for ever
    assert done, "the restore hung on a special file"
    tables, result = done[0]
    assert result.path == older.path and tables["a"].size == 3
    assert f"is not a regular file (a {kind.upper() if kind == 'fifo' else kind})" in (
        result.skipped[0][1])


def test_a_file_that_cannot_be_opened_for_lack_of_descriptors_is_not_damage(
        directory, monkeypatch) -> None:
    write_checkpoint(tables_with(3), directory, keep_latest=3, server_version="t")
    import errno

    from replay_server.checkpoint import fileio

    real_open = os.open

    def no_descriptors(path, flags, *args):
        if str(path).endswith(".bin"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", no_descriptors)
    with pytest.raises(RestoreError, match=r"Too many open files \(EMFILE\).*does not start"):
        restore(directory)
    assert not list(directory.path.glob(f"*/{DAMAGED_NAME}"))
