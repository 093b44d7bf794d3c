"""directory: names, sequence numbers, the lock, atomic commit, pruning and leftovers."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay_server.checkpoint.directory import CheckpointDirectory
from replay_server.errors import ConfigError


def _opened(path: Path) -> CheckpointDirectory:
    directory = CheckpointDirectory(path)
    directory.open()
    return directory


def _commit(directory: CheckpointDirectory, verified: bool = True) -> Path:
    """A committed checkpoint, marked verified as the writer marks one it read back."""
    _, temp, final = directory.begin()
    (temp / "COMPLETE").write_text("x")
    directory.commit(temp, final)
    if verified:
        directory.mark_verified(final)
    return final


def test_open_creates_the_directory_with_parents(tmp_path: Path) -> None:
    directory = _opened(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and (tmp_path / "a" / "b" / "LOCK").is_file()
    directory.close()


def test_checkpoints_get_increasing_sequence_numbers_and_final_names(tmp_path: Path) -> None:
    directory = _opened(tmp_path)
    paths = [_commit(directory) for _ in range(3)]
    refs = directory.complete()
    assert [r.sequence for r in refs] == [1, 2, 3]
    assert [r.path for r in refs] == paths
    assert all(p.name.startswith("ckpt-") and p.name.endswith(f"-{i:06d}")
               for i, p in enumerate(paths, start=1))
    assert directory.temporaries() == []


def test_sequence_continues_after_a_restart(tmp_path: Path) -> None:
    directory = _opened(tmp_path)
    _commit(directory)
    _commit(directory)
    directory.close()
    again = _opened(tmp_path)
    assert again.begin()[0] == 3


def test_a_temporary_is_not_a_checkpoint_until_committed(tmp_path: Path) -> None:
    directory = _opened(tmp_path)
    _, temp, final = directory.begin()
    assert temp.name == final.name + ".tmp"
    assert directory.complete() == [] and directory.temporaries() == [temp]


def test_open_removes_temporaries_left_by_an_interrupted_write(tmp_path: Path, caplog) -> None:
    directory = _opened(tmp_path)
    _commit(directory)
    _, temp, _ = directory.begin()
    (temp / "half-written.bin").write_bytes(b"x" * 10)
    directory.close()
    again = _opened(tmp_path)
    assert not temp.exists() and len(again.complete()) == 1
    assert f"removing unfinished checkpoint {temp}" in caplog.text


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_prune_keeps_the_newest_and_removes_temporaries(tmp_path: Path, keep: int) -> None:
    directory = _opened(tmp_path)
    paths = [_commit(directory) for _ in range(4)]
    _, leftover, _ = directory.begin()
    removed = directory.prune(keep)
    assert [r.path for r in directory.complete()] == paths[-keep:]
    assert set(removed) == set(paths[:-keep]) | {leftover}
    assert not leftover.exists()


def test_prune_removes_nothing_until_keep_latest_newer_checkpoints_are_verified(
    tmp_path: Path
) -> None:
    directory = _opened(tmp_path)
    found = [_commit(directory, verified=False) for _ in range(3)]  # on disk at start, unread
    written = [_commit(directory)]
    assert directory.prune(2) == [] and [r.path for r in directory.complete()] == [*found, *written]
    written.append(_commit(directory))
    assert set(directory.prune(2)) == set(found)  # two verified ones now: the older go
    assert [r.path for r in directory.complete()] == written


def test_an_unverified_newer_checkpoint_does_not_push_out_a_verified_older_one(
    tmp_path: Path
) -> None:
    directory = _opened(tmp_path)
    good = _commit(directory)  # e.g. the one the server restored from
    damaged = [_commit(directory, verified=False) for _ in range(3)]
    assert directory.prune(1) == []
    assert [r.path for r in directory.complete()] == [good, *damaged]


def test_a_checkpoint_found_damaged_is_never_pruned(tmp_path: Path) -> None:
    directory = _opened(tmp_path)
    damaged = _commit(directory, verified=False)
    directory.mark_damaged(damaged)
    plain_old = _commit(directory, verified=False)
    written = [_commit(directory) for _ in range(2)]
    assert set(directory.prune(1)) == {plain_old, written[0]}
    assert [r.path for r in directory.complete()] == [damaged, written[1]]


def test_files_and_directories_are_created_owner_only(tmp_path: Path) -> None:
    directory = _opened(tmp_path / "ckpt")
    path = _commit(directory)
    for made in (tmp_path / "ckpt", tmp_path / "ckpt" / "LOCK", path):
        assert made.stat().st_mode & 0o077 == 0, (made, oct(made.stat().st_mode))


def test_names_that_are_not_checkpoints_are_left_alone(tmp_path: Path) -> None:
    directory = _opened(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "ckpt-backup").mkdir()
    _commit(directory)
    _commit(directory)
    directory.prune(1)
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "ckpt-backup").exists()
    assert len(directory.complete()) == 1


def test_a_second_server_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = _opened(tmp_path)
    with pytest.raises(ConfigError, match="in use by another server"):
        CheckpointDirectory(tmp_path).open()
    first.close()
    CheckpointDirectory(tmp_path).open()  # free again once released


def test_a_path_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match=f"'{path}' is not a directory"):
        CheckpointDirectory(path).open()


def test_a_path_under_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "checkpoints"
    with pytest.raises(ConfigError, match=f"'{path}' cannot be created or written"):
        CheckpointDirectory(path).open()
