"""Writing checkpoints and restoring them: exact round trips and the restore rules.

Restore rules (reader.py): the newest usable checkpoint wins; an incomplete
or damaged one is skipped with a WARNING naming it and the reason; one that
contradicts the config is an error naming both values.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replay_server import TableConfig, TableSet
from replay_server.checkpoint import CheckpointDirectory, load_checkpoint, write_checkpoint
from replay_server.checkpoint.manifest import complete_marker
from replay_server.checkpoint.reader import restore_latest
from replay_server.errors import (
    CheckpointSpaceError,
    CheckpointWriteError,
    ConfigError,
    RestoreError,
)
from tests.server.engine.test_table_errors import assert_same_draw, assert_same_state

CONFIGS = [
    TableConfig(name="uniform", capacity=50, sampler="uniform", seed=1),
    TableConfig(name="prioritized", capacity=40, sampler="prioritized", seed=2),
    TableConfig(name="slice", capacity=60, sampler="slice", slice_len=3, seed=3),
    TableConfig(name="prioritized_slice", capacity=45, sampler="prioritized_slice",
                slice_len=4, seed=4),
    TableConfig(name="empty", capacity=10, sampler="prioritized", seed=5),
]


def _rows(start: int, n: int) -> dict:
    row = torch.arange(start, start + n)
    return {"obs": {"pixels": (row % 251).to(torch.uint8).view(n, 1, 1).expand(n, 2, 3).clone(),
                    "half": row.to(torch.bfloat16).unsqueeze(1)},
            "row": row, "episode": row // 9, "done": row % 9 == 8}


def _filled(configs: list[TableConfig] = CONFIGS, rows: int = 130) -> TableSet:
    tables = TableSet(configs)
    for table in tables:
        if table.name == "empty":
            continue
        for start in range(0, rows, 13):
            ids = table.insert(_rows(start, 13))
            if table.config.sampler.is_prioritized:
                table.update_priorities(ids, torch.rand(13) + 0.01)
        table.sample(5)
    return tables


def assert_restored_state(got: dict, saved: dict) -> None:
    """``got`` (a restored table's state) is ``saved`` but for one new id segment.

    The restored table keeps every saved id segment, the current one ending
    where the saved ring stopped, and begins a segment of an incarnation the
    saved table never used: ids it issues next are new ids.
    """
    got, saved = dict(got), dict(saved)
    got_ids, saved_ids = got.pop("ids"), saved.pop("ids")
    assert_same_state(got, saved)
    next_position = saved["ring"]["next_id"]
    *older, (incarnation, first, _) = saved_ids["segments"]
    assert got_ids["shard"] == saved_ids["shard"]
    assert got_ids["segments"][:-1] == [*older, [incarnation, first, next_position]]
    new_incarnation, new_first, new_end = got_ids["segments"][-1]
    assert (new_first, new_end) == (next_position, -1)
    assert new_incarnation not in [s[0] for s in saved_ids["segments"]]


def _write(tables: TableSet, directory: CheckpointDirectory, keep: int = 10):
    return write_checkpoint(tables, directory, keep_latest=keep, server_version="test")


def test_a_checkpoint_restores_every_table_exactly(directory) -> None:
    tables = _filled()
    result = _write(tables, directory)
    restored = TableSet(CONFIGS)
    load_checkpoint(result.path, restored)
    for table in tables:
        assert_restored_state(restored[table.name].state_dict(), table.state_dict())
        draw_a = table.sample(7) if table.size else None
        draw_b = restored[table.name].sample(7) if table.size else None
        if draw_a is not None:
            assert_same_draw(draw_b, draw_a)  # same rows, ids, priorities and generator


def test_the_result_describes_what_was_written(directory) -> None:
    tables = _filled()
    result = _write(tables, directory)
    assert result.path.is_dir() and result.sequence == 1
    assert result.tables == {"uniform": 50, "prioritized": 40, "slice": 60,
                             "prioritized_slice": 45, "empty": 0}
    on_disk = sum(f.stat().st_size for f in result.path.rglob("*.bin"))
    assert result.nbytes == on_disk > 0


def test_files_are_what_the_manifest_says(directory) -> None:
    import hashlib

    result = _write(_filled(), directory)
    manifest = json.loads((result.path / "manifest.json").read_bytes())
    assert (result.path / "COMPLETE").read_bytes() == complete_marker(
        (result.path / "manifest.json").read_bytes())
    for table in manifest["tables"]:
        for entry in [table["state_file"], *(c["file"] for c in table["columns"])]:
            data = (result.path / entry["name"]).read_bytes()
            assert len(data) == entry["bytes"]
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_keep_latest_prunes_older_checkpoints(directory) -> None:
    tables = _filled()
    paths = [_write(tables, directory, keep=2).path for _ in range(4)]
    assert [r.path for r in directory.complete()] == paths[-2:]


# ------------------------------------------------------------------ restore rules


def _truncate(path: Path) -> str:
    target = path / "prioritized" / "column-0.bin"
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) - 10)
    return "prioritized/column-0.bin is 230 bytes but the manifest says 240 (truncated)"


def _flip_column_byte(path: Path) -> str:
    target = path / "uniform" / "column-2.bin"
    data = bytearray(target.read_bytes())
    data[17] ^= 0xFF
    target.write_bytes(bytes(data))
    return "uniform/column-2.bin: sha256"


def _flip_state_byte(path: Path) -> str:
    target = path / "slice" / "state.bin"
    data = bytearray(target.read_bytes())
    data[3] ^= 0x01
    target.write_bytes(bytes(data))
    return "slice/state.bin: sha256"


def _remove_complete(path: Path) -> str:
    (path / "COMPLETE").unlink()
    return "no COMPLETE marker"


def _edit_manifest(path: Path) -> str:
    manifest = path / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"capacity": 40', b'"capacity": 41'))
    return "manifest.json does not match the sha256 recorded in COMPLETE"


def _garble_manifest_and_marker(path: Path) -> str:
    data = b'{"format": "replay-server-checkpoint", "tables": ['
    (path / "manifest.json").write_bytes(data)
    (path / "COMPLETE").write_bytes(complete_marker(data))
    return "manifest.json is not valid JSON"


def _remove_file(path: Path) -> str:
    (path / "slice" / "column-1.bin").unlink()
    return "cannot open slice/column-1.bin"


def _bad_ring(path: Path) -> str:
    manifest = json.loads((path / "manifest.json").read_bytes())
    manifest["tables"][0]["state"]["ring"]["first_live"] = 10**6
    data = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(data)
    (path / "COMPLETE").write_bytes(complete_marker(data))
    return "saved state is malformed"


CORRUPTIONS = [_truncate, _flip_column_byte, _flip_state_byte, _remove_complete, _edit_manifest,
               _garble_manifest_and_marker, _remove_file, _bad_ring]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(
    directory, corrupt: Callable[[Path], str], caplog
) -> None:
    tables = _filled(rows=65)
    older = _write(tables, directory)
    expected = {t.name: t.state_dict() for t in tables}
    for table in tables:
        if table.name != "empty":
            table.insert(_rows(1000, 13))
    newest = _write(tables, directory)
    reason = corrupt(newest.path)
    with caplog.at_level(logging.WARNING, logger="replay_server.checkpoint"):
        restored, result = restore_latest(directory, lambda: TableSet(CONFIGS))
    assert result.path == older.path
    assert [p for p, _ in result.skipped] == [newest.path]
    assert f"skipping checkpoint {newest.path}: " in caplog.text
    assert reason in caplog.text, caplog.text
    for name, state in expected.items():
        assert_restored_state(restored[name].state_dict(), state)


def test_no_usable_checkpoint_refuses_to_start_naming_each_and_why(directory) -> None:
    first, second = _write(_filled(), directory), _write(_filled(), directory)
    _remove_complete(first.path)
    _truncate(second.path)
    with pytest.raises(RestoreError) as info:
        restore_latest(directory, lambda: TableSet(CONFIGS))
    message = str(info.value)
    assert "none of the 2 checkpoint(s)" in message and "does not start" in message
    assert f"{first.path.name}: no COMPLETE marker" in message
    assert f"{second.path.name}: prioritized/column-0.bin is 230 bytes" in message
    assert "start_empty_if_unrestorable" in message


def test_no_usable_checkpoint_starts_empty_only_when_asked_and_keeps_them(
    directory, caplog
) -> None:
    result = _write(_filled(), directory)
    _remove_complete(result.path)
    with caplog.at_level(logging.WARNING, logger="replay_server.checkpoint"):
        assert restore_latest(directory, lambda: TableSet(CONFIGS), start_empty=True) is None
    assert "none of the 1 checkpoint(s)" in caplog.text
    assert "starting with empty tables as server.start_empty_if_unrestorable asks" in caplog.text
    assert [r.path for r in directory.complete()] == [result.path]


def test_a_failure_that_is_not_damage_stops_the_restore_without_trying_older(
    directory, monkeypatch
) -> None:
    older = _write(_filled(), directory)
    newest = _write(_filled(), directory)
    from replay_server.engine.table import Table

    loaded = []

    def out_of_memory(self, state, read_rows=None):
        loaded.append(self.name)
        raise MemoryError()

    monkeypatch.setattr(Table, "load_state_dict", out_of_memory)
    with pytest.raises(RestoreError, match=f"checkpoint {newest.path} could not be loaded: "
                                           f"MemoryError"):
        restore_latest(directory, lambda: TableSet(CONFIGS))
    assert len(loaded) == 1  # the older one was not tried: it is no fallback for a full machine
    assert [r.path for r in directory.complete()] == [older.path, newest.path]


def test_a_written_checkpoint_that_does_not_read_back_is_removed_and_prunes_nothing(
    directory, monkeypatch
) -> None:
    import replay_server.checkpoint.writer as writer

    kept = _write(_filled(), directory, keep=1)

    def differs(path, data, manifest):
        raise OSError(5, "reads back differently")

    monkeypatch.setattr(writer, "_verify", differs)
    with pytest.raises(CheckpointWriteError, match="reads back differently"):
        _write(_filled(), directory, keep=1)
    assert [r.path for r in directory.complete()] == [kept.path]


def test_an_empty_directory_restores_nothing(directory) -> None:
    assert restore_latest(directory, lambda: TableSet(CONFIGS)) is None


def _reconfigured(name: str, **changes) -> list[TableConfig]:
    import dataclasses

    return [dataclasses.replace(c, **changes) if c.name == name else c for c in CONFIGS]


@pytest.mark.parametrize(("configs", "fragments"), [
    (_reconfigured("uniform", capacity=64),
     ["table 'uniform': config says capacity=64 but the saved state has capacity=50"]),
    (_reconfigured("prioritized", sampler="uniform"),
     ["config says sampler='uniform' but the saved state has sampler='prioritized'"]),
    (_reconfigured("slice", slice_len=5),
     ["config says slice_len=5 but the saved state has slice_len=3"]),
    ([c for c in CONFIGS if c.name != "slice"],
     ["holds table(s) ['slice'] which the config does not declare"]),
])
def test_a_checkpoint_contradicting_the_config_is_an_error_naming_both(
    directory, configs: list[TableConfig], fragments: list[str]
) -> None:
    result = _write(_filled(), directory)
    with pytest.raises(ConfigError) as info:
        restore_latest(directory, lambda: TableSet(configs))
    assert f"checkpoint {result.path} does not fit the config" in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_a_schema_contradicting_the_config_is_an_error_naming_both(directory) -> None:
    from replay_server import FieldSpec

    configs = [TableConfig(name="t", capacity=8, schema={"x": FieldSpec(torch.float32, (2,))})]
    tables = TableSet([TableConfig(name="t", capacity=8)])
    tables["t"].insert({"x": torch.zeros(3, 4)})
    _write(tables, directory)
    with pytest.raises(ConfigError, match=r"schema is \{'x': 'float32\[2\]'\} but the saved "
                                          r"state has \{'x': 'float32\[4\]'\}"):
        restore_latest(directory, lambda: TableSet(configs))


def test_a_table_added_to_the_config_starts_empty(directory) -> None:
    _write(_filled(), directory)
    configs = [*CONFIGS, TableConfig(name="new", capacity=5)]
    restored, _ = restore_latest(directory, lambda: TableSet(configs))
    assert restored["new"].size == 0 and restored["uniform"].size == 50


def test_a_newer_format_is_an_error_not_a_skip(directory) -> None:
    result = _write(_filled(), directory)
    manifest = json.loads((result.path / "manifest.json").read_bytes())
    manifest["format_version"] = 99
    data = json.dumps(manifest).encode()
    (result.path / "manifest.json").write_bytes(data)
    (result.path / "COMPLETE").write_bytes(complete_marker(data))
    with pytest.raises(ConfigError, match="format version 99; this server reads version 1"):
        restore_latest(directory, lambda: TableSet(CONFIGS))


# ------------------------------------------------------------------- write errors


def test_a_directory_that_became_a_file_fails_cleanly_and_later_works(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path / "ckpt")
    directory.open()
    tables = _filled()
    moved = tmp_path / "moved"
    (tmp_path / "ckpt").rename(moved)
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointWriteError) as info:
        _write(tables, directory)
    assert not isinstance(info.value, CheckpointSpaceError)
    assert f"checkpoint failed writing {tmp_path / 'ckpt'}" in str(info.value)
    assert "Not a directory" in str(info.value) and "keep serving" in str(info.value)
    (tmp_path / "ckpt").unlink()
    moved.rename(tmp_path / "ckpt")
    result = _write(tables, directory)
    assert result.path.parent == tmp_path / "ckpt" and directory.temporaries() == []


def test_a_failed_write_leaves_no_temporary_behind(directory, monkeypatch) -> None:
    import replay_server.checkpoint.writer as writer

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_file", fail)
    with pytest.raises(CheckpointSpaceError, match=r"No space left on device \(ENOSPC\)"):
        _write(_filled(), directory)
    assert directory.temporaries() == [] and directory.complete() == []
