"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay_server.checkpoint import CheckpointDirectory


@pytest.fixture
def directory(tmp_path: Path):
    """An open, empty checkpoint directory under the test's temporary path."""
    directory = CheckpointDirectory(tmp_path / "ckpt")
    directory.open()
    yield directory
    directory.close()
