"""A compressed table through a real server: rows come back identical after a checkpoint and
a restart (the checkpoint streams decompressed rows; the restore compresses them again)."""

from __future__ import annotations

from pathlib import Path

import torch

from replay_client import ReplayClient
from tests.server.engine.storage.test_compressed import rows


def test_checkpoints_round_trip_through_a_real_server(server_factory, tmp_path: Path) -> None:
    config = f"""
[server]
checkpoint_dir = "{tmp_path / 'ckpt'}"

[[tables]]
name = "packed"
capacity = 64
sampler = "fifo"
compress_keys = ["obs"]
"""
    first = server_factory(config)
    client = ReplayClient(first.address, timeout=30)
    data = rows(0, 50)
    client.insert("packed", data)
    client.checkpoint()
    assert first.stop() == 0
    again = server_factory(config)
    batch = ReplayClient(again.address, timeout=30).sample("packed", 50)
    assert torch.equal(batch.data["obs"], data["obs"])
    assert torch.equal(batch.data["half"], data["half"])
