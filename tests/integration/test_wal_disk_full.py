"""The write-ahead log's disk fills up: writes are refused, samples go on, nothing is lost.

A real server process logs into a small tmpfs (``wal_dir``) that a filler
file nearly fills. Inserts past the space are refused with RESOURCE_EXHAUSTED
naming the log's disk, nothing of them stored, while samples keep being
served; once the filler is removed writes resume by themselves. After a
``kill -9`` the restarted server has every acknowledged row, bit for bit,
with its id, and issues none of those ids again.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_client.errors import LimitExceededError
from tests.conftest import start_server
from tests.small_disk import fill, small_disk


def _config(tmp_path: Path, disk: Path) -> str:
    return f"""
[server]
checkpoint_dir = "{tmp_path / 'ckpt'}"
checkpoint_interval_s = 0
wal = true
wal_dir = "{disk / 'wal'}"
wal_max_mb = 64

[[tables]]
name = "replay"
capacity = 100_000
sampler = "uniform"
"""


def _rows(k: int, n: int = 1024) -> np.ndarray:
    return np.random.default_rng(k).random((n, 16)).astype(np.float32)  # n=1024: 64 KiB


@pytest.mark.parametrize(("n", "shared"), [(1024, "0"), (1024, "1"), (64, "1")],
                         ids=["chunked-64KiB", "region-64KiB", "call-stream-4KiB"])
def test_a_full_disk_refuses_writes_keeps_samples_and_loses_nothing(tmp_path, monkeypatch,
                                                                    n, shared) -> None:
    """64 KiB inserts are unary calls (from another host) or written into a shared-memory
    region (from this host), stored in the engine's pool; 4 KiB ones ride the client's call
    stream and are stored on the server's event loop, their answers awaiting the log there:
    the same refusals, the same guarantees."""
    monkeypatch.setenv("REPLAY_SHARED_MEMORY", shared)
    calls = 1024 // n * 40
    with small_disk(tmp_path / "disk", 8 << 20) as disk:
        filler = fill(disk, leave=1 << 20)
        config = _config(tmp_path, disk)
        server = start_server(tmp_path, config)
        client = ReplayClient(server.address)
        ids, rows = [], []
        try:
            with pytest.raises(LimitExceededError) as refused:
                for k in range(calls):  # 2.5 MB through about 1 MB of free space
                    ids.append(client.insert("replay", {"obs": _rows(k, n)}).numpy())
                    rows.append(_rows(k, n))
            message = str(refused.value)
            assert "no space left on the write-ahead log's disk" in message
            assert str(disk / "wal") in message and "nothing of it is stored" in message
            assert 4 <= len(ids) * n // 1024 < 17
            session = client._stream("insert")._session
            through_region = session is not None and session.region is not None
            assert through_region == (n == 1024 and shared == "1")
            assert client.info()["replay"].size == n * len(ids)  # the refused: nothing
            assert client.sample("replay", batch_size=8).ids.numel() == 8  # samples go on
            with pytest.raises(LimitExceededError, match="no space left"):
                client.insert("replay", {"obs": _rows(99, n)})

            filler.unlink()  # the operator makes room: writes resume by themselves
            ids.append(client.insert("replay", {"obs": _rows(100, n)}).numpy())
            rows.append(_rows(100, n))
        finally:
            client.close()
            server.stop(signal.SIGKILL)

        server = start_server(tmp_path, config, name="second")
        client = ReplayClient(server.address)
        try:
            stored = np.concatenate(ids)
            read = client.read("replay", ids=stored)
            assert read.columns["obs"].numpy().tobytes() == np.concatenate(rows).tobytes()
            assert client.info()["replay"].size == len(stored)
            new = client.insert("replay", {"obs": _rows(101)}).numpy()
            assert not set(new.tolist()) & set(stored.tolist())  # no id issued twice
        finally:
            client.close()
            server.stop(signal.SIGKILL)
