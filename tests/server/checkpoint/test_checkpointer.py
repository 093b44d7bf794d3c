"""Checkpointer: one checkpoint at a time; a request always gets one that started after it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from replay_server import TableConfig, TableSet
from replay_server.checkpoint import Checkpointer
from replay_server.errors import CheckpointWriteError

WAIT_S = 30


def _tables() -> TableSet:
    tables = TableSet([TableConfig(name="t", capacity=100)])
    tables["t"].insert({"x": torch.arange(10.0)})
    return tables


@pytest.fixture
def checkpointer(tmp_path: Path):
    checkpointer = Checkpointer(tmp_path / "ckpt", keep_latest=10, server_version="test")
    checkpointer.open()
    yield checkpointer
    checkpointer.close()


def _waiters(checkpointer: Checkpointer) -> int:
    return len(checkpointer._cond._waiters)  # type: ignore[attr-defined]


def test_requests_during_a_checkpoint_share_the_next_one(checkpointer) -> None:
    tables = _tables()
    table = tables["t"]
    results: dict[str, object] = {}

    def request(name: str) -> None:
        results[name] = checkpointer.checkpoint(tables, name)

    with table._lock:  # the first checkpoint blocks on its snapshot until released
        first = threading.Thread(target=request, args=("first",))
        first.start()
        deadline = time.monotonic() + WAIT_S
        while not checkpointer._running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checkpointer._running
        later = [threading.Thread(target=request, args=(f"later{i}",)) for i in range(3)]
        for thread in later:
            thread.start()
        while _waiters(checkpointer) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _waiters(checkpointer) == 3
    for thread in [first, *later]:
        thread.join(WAIT_S)
    paths = {name: result.path for name, result in results.items()}
    assert len(paths) == 4
    # the three later requests got one checkpoint, which started after the first ended
    assert len({paths["later0"], paths["later1"], paths["later2"]}) == 1
    assert results["later0"].sequence == results["first"].sequence + 1
    assert len(checkpointer.directory.complete()) == 2
    assert checkpointer.last == results["later0"]


def test_sequential_requests_each_write_a_checkpoint(checkpointer) -> None:
    tables = _tables()
    sequences = [checkpointer.checkpoint(tables).sequence for _ in range(3)]
    assert sequences == [1, 2, 3]


def test_a_failure_reaches_the_caller_and_is_logged_and_the_next_one_works(
    checkpointer, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="replay_server.checkpoint")
    tables = _tables()
    path = checkpointer.path
    path.rename(tmp_path / "away")
    path.write_text("x")
    with pytest.raises(CheckpointWriteError):
        checkpointer.checkpoint(tables, "test")
    assert "checkpoint (test) failed: checkpoint failed writing" in caplog.text
    assert checkpointer.last is None
    path.unlink()
    (tmp_path / "away").rename(path)
    result = checkpointer.checkpoint(tables, "test")
    assert checkpointer.last == result
    assert f"checkpoint (test) written: {result.path}" in caplog.text
