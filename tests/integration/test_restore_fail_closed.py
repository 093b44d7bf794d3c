"""Restore fails closed, pruning keeps verified checkpoints, files are owner-only.

Issue 10, finding 2: with no usable checkpoint the server started empty and
reported SERVING, and its shutdown checkpoint then pruned the damaged ones;
any exception while loading (MemoryError included) counted as "corrupt, try
an older one". Finding 13: checkpoint files were world-readable. Real server
processes and real files throughout.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import serve_until_exit, start_server

CONFIG = """
[server]
checkpoint_dir = "{directory}"
checkpoint_interval_s = 0
keep_latest = {keep}
{extra}

[[tables]]
name = "replay"
capacity = 10_000
sampler = "prioritized"
"""


def config(directory: Path, extra: str = "", keep: int = 1) -> str:
    return CONFIG.format(directory=directory, extra=extra, keep=keep)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A checkpoint directory holding two complete checkpoints (rows of 1 KiB) from a server
    that was then killed."""
    tmp_path = tmp_path_factory.mktemp("written")
    server = start_server(tmp_path, config(tmp_path / "ckpt", keep=5))
    client = ReplayClient(server.address)
    for start in (0, 500):
        client.insert("replay", {"obs": torch.full((500, 256), float(start))})
        client.checkpoint()
    server.stop(signal.SIGKILL)
    return tmp_path / "ckpt"


def checkpoints(directory: Path) -> list[Path]:
    return sorted(directory.glob("ckpt-*"))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file of every checkpoint, by path (not the DAMAGED marks a restore adds)."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in directory.glob("ckpt-*/**/*") if p.is_file() and p.name != "DAMAGED"}


def test_checkpoint_files_and_directories_are_owner_only(written: Path) -> None:
    made = [written, *written.rglob("*")]
    assert len(made) > 10
    for path in made:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_no_restorable_checkpoint_refuses_to_start_and_prunes_nothing(
    written: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    older, newest = checkpoints(directory)
    (newest / "COMPLETE").unlink()
    column = older / "replay" / "column-0.bin"
    column.write_bytes(column.read_bytes()[:-8])
    damaged = snapshot(directory)

    code, output = serve_until_exit(tmp_path, config(directory))
    assert code == 2, output
    assert "none of the 2 checkpoint(s)" in output and "does not start" in output
    assert f"{newest.name}: no COMPLETE marker" in output
    assert f"{older.name}: replay/column-0.bin is" in output and "(truncated)" in output
    assert "start_empty_if_unrestorable" in output
    assert snapshot(directory) == damaged
    assert (newest / "DAMAGED").exists() and (older / "DAMAGED").exists()  # kept for good

    # The operator opts in: the server starts empty and keeps the damaged checkpoints,
    # even after its own shutdown checkpoint (keep_latest = 1).
    server = start_server(tmp_path, config(directory), extra_args=("--start-empty-if-unrestorable",))
    client = ReplayClient(server.address)
    assert client.info()["replay"].size == 0
    client.insert("replay", {"obs": torch.zeros(3, 256)})
    assert server.stop(signal.SIGTERM) == 0
    assert "starting with empty tables as server.start_empty_if_unrestorable asks" in server.log()
    kept = checkpoints(directory)
    assert kept[:2] == [older, newest] and len(kept) == 3
    assert {k: v for k, v in snapshot(directory).items() if k in damaged} == damaged


def test_a_checkpoint_too_large_for_memory_stops_the_start_and_older_ones_are_not_tried(
    written: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    before = snapshot(directory)
    # Rows of 1 KiB at capacity 10,000 need about 10 MB; allow the tables 5 MB.
    code, output = serve_until_exit(tmp_path, config(directory, "table_memory_mb = 5"))
    assert code == 2, output
    newest = checkpoints(directory)[-1]
    assert f"checkpoint {newest} could not be loaded" in output
    assert "server.table_memory_mb" in output and "does not start" in output
    assert "skipping checkpoint" not in output  # not damage: nothing older is tried
    assert snapshot(directory) == before


def test_a_damaged_checkpoint_is_kept_through_later_restarts(written: Path, tmp_path: Path) -> None:
    """Issue 23, finding 10: the damaged checkpoint (it held the newest rows) was deleted on
    the second restart, once a newer one restored and nobody looked at it again."""
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    newest = checkpoints(directory)[-1]
    column = newest / "replay" / "column-0.bin"
    column.write_bytes(column.read_bytes()[:-8])
    for run in range(3):  # keep_latest = 1: each run writes one and prunes the rest
        server = start_server(tmp_path, config(directory), name=f"run{run}")
        client = ReplayClient(server.address)
        client.insert("replay", {"obs": torch.full((10, 256), float(run))})
        client.checkpoint()
        assert server.stop() == 0
        assert newest in checkpoints(directory), f"pruned in run {run}"
    assert "truncated" in (newest / "DAMAGED").read_text()
    assert len(checkpoints(directory)) == 2  # the damaged one and the newest good one
