"""The same-host shared-memory ring: creation, mapping checks, lifetime, a full /dev/shm."""

from __future__ import annotations

import os

import pytest
import torch

from replay_feed.shared_ring import SharedMemoryError, SharedRing, shm_dir, sweep_stale_rings


def test_a_mapped_ring_shares_bytes_with_its_creator():
    ring = SharedRing.create(3, 1000)
    try:
        other = SharedRing.open(ring.name, ring.token, ring.slots, ring.slot_bytes, ring.header_bytes)
        ring.view(2, 64, torch.float32, (4, 2)).copy_(torch.arange(8.0).view(4, 2))
        assert torch.equal(other.view(5, 64, torch.float32, (4, 2)), torch.arange(8.0).view(4, 2))
        assert ring.slot_bytes % 4096 == 0 and ring.slot(0).shape == (ring.slot_bytes,)
    finally:
        ring.unlink()
    assert not (shm_dir() / ring.name).exists()


def test_views_outlive_close_and_unlink():
    ring = SharedRing.create(1, 64)
    view = ring.view(0, 0, torch.int64, (8,))
    view.copy_(torch.arange(8))
    ring.unlink()
    ring.close()
    assert torch.equal(view, torch.arange(8))  # the mapping lives as long as its views


def test_open_refuses_a_wrong_token_size_or_name():
    ring = SharedRing.create(2, 128)
    try:
        with pytest.raises(SharedMemoryError, match="token differs"):
            SharedRing.open(ring.name, b"x" * 16, ring.slots, ring.slot_bytes, ring.header_bytes)
        with pytest.raises(SharedMemoryError, match="the offer says"):
            SharedRing.open(ring.name, ring.token, ring.slots + 1, ring.slot_bytes, ring.header_bytes)
        with pytest.raises(SharedMemoryError, match="not a replay shared-memory ring name"):
            SharedRing.open("../etc/passwd", ring.token, 1, 1, 4096)
        with pytest.raises(SharedMemoryError, match="cannot open"):
            SharedRing.open("replay-1-0123456789abcdef", ring.token, 1, 4096, 4096)
    finally:
        ring.unlink()


def test_views_must_fit_the_slot_and_be_aligned():
    ring = SharedRing.create(1, 4096)
    try:
        with pytest.raises(SharedMemoryError, match="do not fit"):
            ring.view(0, 4000, torch.float64, (100,))
        with pytest.raises(SharedMemoryError, match="alignment"):
            ring.view(0, 8, torch.float64, (1,))
    finally:
        ring.unlink()


def test_a_missing_or_full_directory_is_an_error_at_creation(monkeypatch, tmp_path):
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path / "absent"))
    with pytest.raises(SharedMemoryError, match="cannot create"):
        SharedRing.create(1, 64)
    # Reserving more than the filesystem holds fails up front (never a SIGBUS later),
    # and without reserving anything: on a disk file system (tmp_path here) a
    # reservation that does not fit would fill the disk for everyone until it failed.
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    reserved: list[int] = []
    real_fallocate = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        reserved.append(length)
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(SharedMemoryError, match="--shm-size"):
        SharedRing.create(2, free)
    assert reserved == []
    assert not os.listdir(tmp_path)
    SharedRing.create(1, 64).unlink()  # one that fits is reserved
    assert reserved == [SharedRing.size_for(1, 64)]


def test_the_size_of_a_ring_is_a_page_of_header_and_page_aligned_slots():
    import mmap

    assert SharedRing.size_for(3, 100) == mmap.PAGESIZE * 4
    ring = SharedRing.create(3, 100)
    try:
        assert ring.nbytes == SharedRing.size_for(3, 100) == os.path.getsize(ring.path)
    finally:
        ring.unlink()


def test_the_sweep_removes_rings_of_dead_processes_only(monkeypatch, tmp_path):
    import subprocess
    import sys

    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)  # exited: its pid names no process (unless reused at once)
    names = {"dead": f"replay-{dead_pid}-{'0' * 16}", "alive": f"replay-{os.getpid()}-{'1' * 16}",
             "other": "replay-notes", "unrelated": "someone-elses"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale_rings() == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "dead")
