"""A damaged write-ahead log: each kind of damage has its documented outcome (docs/durability.md).

Real server processes with ``wal = true`` are killed with SIGKILL, their log
files changed as a disk or an operator would, and started again: a torn
tail (or a flipped byte in the last record) is cut and reported, and every
other acknowledged row comes back; a flipped byte in the middle, a missing
segment or a segment of another incarnation stops the start with a message
naming the segment (and the offset). The log's size bound refuses writes
with RESOURCE_EXHAUSTED naming ``server.wal_max_mb`` while samples go on.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_client.errors import LimitExceededError
from replay_server.checkpoint.wal import records
from tests.conftest import start_server


def _config(directory: Path, *, wal: bool = True, extra: str = "") -> str:
    return f"""
[server]
checkpoint_dir = "{directory}"
checkpoint_interval_s = 0
wal = {'true' if wal else 'false'}
{extra}

[[tables]]
name = "replay"
capacity = 10_000
sampler = "prioritized"
"""


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 16)).astype(np.float32)


def _run(tmp_path: Path, name: str, inserts: int, seed: int) -> tuple[list[np.ndarray], list]:
    """Start a server, make ``inserts`` inserts of 4 rows (one record each), kill -9 it."""
    server = start_server(tmp_path, _config(tmp_path / "ckpt"), name=name)
    client = ReplayClient(server.address)
    ids, rows = [], []
    for k in range(inserts):
        data = _rows(4, seed + k)
        ids.append(client.insert("replay", {"obs": data}).numpy())
        rows.append(data)
    client.close()
    server.stop(signal.SIGKILL)
    return ids, rows


def _segments(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "ckpt").glob("wal-*.log"))


def _present(address: str, ids: list[np.ndarray], rows: list[np.ndarray]) -> None:
    client = ReplayClient(address)
    try:
        read = client.read("replay", ids=np.concatenate(ids))
        assert read.columns["obs"].numpy().tobytes() == np.concatenate(rows).tobytes()
    finally:
        client.close()


def _refused(tmp_path: Path, name: str) -> str:
    with pytest.raises(RuntimeError) as failed:
        start_server(tmp_path, _config(tmp_path / "ckpt"), name=name)
    return str(failed.value)


def _last_record(segment: Path) -> tuple[int, int]:
    scan = records.scan(segment.read_bytes())
    offset, payload = scan.records[-1]
    return offset, len(payload)


def test_a_torn_tail_is_cut_and_reported(tmp_path) -> None:
    ids, rows = _run(tmp_path, "first", inserts=5, seed=0)
    segment = _segments(tmp_path)[-1]
    offset, length = _last_record(segment)
    cut_at = offset + records.RECORD_HEADER_BYTES + length // 2
    with open(segment, "r+b") as file:  # the last write got half way
        file.truncate(cut_at)
    server = start_server(tmp_path, _config(tmp_path / "ckpt"), name="second")
    try:
        log = server.log()
        assert "cut the write-ahead log's torn tail" in log and f"offset {offset}" in log
        assert segment.name in log and "never acknowledged" in log
        _present(server.address, ids[:-1], rows[:-1])
        assert ReplayClient(server.address).info()["replay"].size == 16
    finally:
        server.stop(signal.SIGKILL)
    assert segment.stat().st_size == offset  # cut at the last whole record


def test_a_flipped_byte_in_the_last_record_is_cut(tmp_path) -> None:
    ids, rows = _run(tmp_path, "first", inserts=4, seed=10)
    segment = _segments(tmp_path)[-1]
    offset, length = _last_record(segment)
    data = bytearray(segment.read_bytes())
    data[offset + records.RECORD_HEADER_BYTES + length - 3] ^= 0x40
    segment.write_bytes(bytes(data))
    server = start_server(tmp_path, _config(tmp_path / "ckpt"), name="second")
    try:
        log = server.log()
        assert "checksum does not match" in log and f"offset {offset} of {segment}" in log
        _present(server.address, ids[:-1], rows[:-1])
    finally:
        server.stop(signal.SIGKILL)


def test_a_flipped_byte_in_the_middle_fails_closed(tmp_path) -> None:
    _run(tmp_path, "first", inserts=5, seed=20)
    segment = _segments(tmp_path)[-1]
    offset, _ = records.scan(segment.read_bytes()).records[2]
    data = bytearray(segment.read_bytes())
    data[offset + records.RECORD_HEADER_BYTES + 40] ^= 0x01
    segment.write_bytes(bytes(data))
    message = _refused(tmp_path, "second")
    assert f"segment {segment} is damaged at offset {offset}" in message
    assert "damage in the middle of the log" in message
    assert segment.read_bytes() == bytes(data)  # nothing thrown away


def test_a_missing_segment_fails_closed(tmp_path) -> None:
    for run in range(3):  # each run begins a segment of its own
        _run(tmp_path, f"run{run}", inserts=2, seed=30 + 10 * run)
    segments = _segments(tmp_path)
    assert len(segments) == 3
    segments[1].unlink()
    message = _refused(tmp_path, "again")
    assert f"segment {segments[1].name} is missing" in message


def test_a_segment_of_another_incarnation_fails_closed(tmp_path) -> None:
    _run(tmp_path, "first", inserts=2, seed=40)
    segment = _segments(tmp_path)[-1]
    data = segment.read_bytes()
    index = int(segment.stem.split("-")[1])
    foreign = records.segment_header(0, 999, index)  # an incarnation this directory never gave out
    segment.write_bytes(foreign + data[len(foreign):])
    message = _refused(tmp_path, "second")
    assert f"{segment} was written by incarnation 999" in message
    assert "a log from another server or directory" in message


def test_a_log_found_with_wal_off_stops_the_start(tmp_path) -> None:
    _run(tmp_path, "first", inserts=1, seed=50)
    with pytest.raises(RuntimeError, match="server.wal is false but .* holds a write-ahead log"):
        start_server(tmp_path, _config(tmp_path / "ckpt", wal=False), name="second")


def test_past_the_bound_writes_are_refused_and_samples_go_on(tmp_path) -> None:
    """No checkpoint_dir: nothing can truncate the log, so past wal_max_mb inserts are refused
    (RESOURCE_EXHAUSTED naming the setting) and nothing acknowledged is lost."""
    config = f"""
[server]
wal = true
wal_dir = "{tmp_path / 'wal'}"
wal_max_mb = 1

[[tables]]
name = "replay"
capacity = 100_000
sampler = "uniform"
"""
    server = start_server(tmp_path, config)
    assert "write-ahead log on in" in server.log() and "(wal_sync = fsync: " in server.log()
    info = subprocess.run([sys.executable, "-m", "replay_server.app.cli", "info", "--address",
                           server.address], capture_output=True, text=True, timeout=120)
    assert "write-ahead log (wal_sync = fsync)" in info.stdout, info.stderr
    client = ReplayClient(server.address)
    ids, rows = [], []
    with pytest.raises(LimitExceededError, match="server.wal_max_mb") as refused:
        for k in range(100):  # 64 KiB each: the 1 MB bound is passed within 17
            data = _rows(1024, k)
            ids.append(client.insert("replay", {"obs": data}).numpy())
            rows.append(data)
    assert "nothing of it is stored" in str(refused.value)
    size = client.info()["replay"].size
    assert size == 1024 * len(ids) and 10 <= len(ids) < 17
    assert client.sample("replay", batch_size=8).ids.numel() == 8  # samples go on
    client.close()
    server.stop(signal.SIGKILL)
    server = start_server(tmp_path, config, name="second")
    try:
        _present(server.address, ids, rows)
        assert ReplayClient(server.address).info()["replay"].size == size
    finally:
        server.stop(signal.SIGKILL)


def test_past_the_bound_an_early_checkpoint_truncates_the_log(tmp_path) -> None:
    server = start_server(tmp_path, _config(tmp_path / "ckpt", extra="wal_max_mb = 1"))
    client = ReplayClient(server.address)
    try:
        for k in range(40):  # 2.5 MB through a 1 MB log
            client.insert("replay", {"obs": _rows(1024, k)})
        total = sum(p.stat().st_size for p in _segments(tmp_path))
        assert total <= 1 << 20
        assert "write-ahead log" in server.log() and "checkpoint (write-ahead log" in server.log()
    finally:
        client.close()
        server.stop(signal.SIGKILL)
