"""Memory-mapped tables through a real server: round trip, a restart from a checkpoint, and
a storage_dir that cannot serve refused at start naming it."""

from __future__ import annotations

from pathlib import Path

import torch

from replay_client import ReplayClient
from tests.conftest import serve_until_exit


def config(tmp_path: Path, storage_dir: Path) -> str:
    return f"""
[server]
checkpoint_dir = "{tmp_path / 'ckpt'}"

[[tables]]
name = "frames"
capacity = 300
storage = "memmap"
storage_dir = "{storage_dir}"
"""


def test_rows_round_trip_and_survive_a_restart(server_factory, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    first = server_factory(config(tmp_path, disk))
    client = ReplayClient(first.address, timeout=30)
    obs = torch.randint(0, 255, (500, 84, 84), dtype=torch.uint8)  # wraps the 300-row ring
    ids = torch.cat([client.insert("frames", {"obs": obs[i:i + 100], "n": torch.arange(i, i + 100)})
                     for i in range(0, 500, 100)])
    batch = client.sample("frames", 64)
    kept = {int(i): n for i, n in zip(ids[200:], range(200, 500))}
    for row_id, n, frame in zip(batch.ids.tolist(), batch.data["n"].tolist(), batch.data["obs"]):
        assert kept[row_id] == n and torch.equal(frame, obs[n])
    info = client.info()["frames"]
    assert info.size == 300 and info.storage_bytes == 300 * (84 * 84 + 8)
    client.checkpoint()
    assert first.stop() == 0
    again = server_factory(config(tmp_path, disk))
    client = ReplayClient(again.address, timeout=30)
    assert client.info()["frames"].size == 300
    batch = client.sample("frames", 64)
    for row_id, n, frame in zip(batch.ids.tolist(), batch.data["n"].tolist(), batch.data["obs"]):
        assert kept[row_id] == n and torch.equal(frame, obs[n])


def test_a_missing_storage_dir_stops_the_start_naming_it(tmp_path: Path) -> None:
    code, output = serve_until_exit(tmp_path, config(tmp_path, tmp_path / "absent"))
    assert code != 0
    assert f"table 'frames': storage_dir '{tmp_path / 'absent'}' does not exist" in output
