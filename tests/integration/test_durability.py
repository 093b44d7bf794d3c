"""Durability through real server processes and real files: crashes, shutdowns,
damaged checkpoints, a full disk, contradicting configs and the restore itself.

Rows carry a ``tag`` the client chose, so every restored row can be checked
against what the client was told when it inserted it (ids -> tags).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_client import ReplayClient, ReplayError, errors
from replay_server import TableSet
from replay_server.checkpoint import load_checkpoint
from replay_server.app.config_file import settings_from_dict
from tests.conftest import ServerProcess, serve_until_exit, start_server
from tests.integration.test_unavailable import free_port

WAIT_S = 60
MAX_CALLS = 100_000


def config(directory: Path, *, capacity: int = 50_000, interval: float = 0, keep: int = 3) -> str:
    return f"""
[server]
checkpoint_dir = "{directory}"
checkpoint_interval_s = {interval}
keep_latest = {keep}

[[tables]]
name = "prioritized"
capacity = {capacity}
sampler = "prioritized"
seed = 1

[[tables]]
name = "sequences"
capacity = 20_000
sampler = "prioritized_slice"
slice_len = 4
seed = 2
"""


def rows(tags: torch.Tensor, episode: int | None = None) -> dict[str, torch.Tensor]:
    data = {"obs": tags.to(torch.float32).unsqueeze(1).repeat(1, 8), "tag": tags}
    if episode is not None:
        data["episode"] = torch.full_like(tags, episode)
        data["done"] = torch.arange(len(tags)) == len(tags) - 1
    return data


class Load:
    """Client threads inserting continuously, remembering every acknowledged id -> tag."""

    def __init__(self, address: str, threads: int = 3, rows_per_call: int = 16) -> None:
        self.stop = threading.Event()
        self.acked: dict[int, int] = {}  # id -> tag, per table below
        self.acked_sequences: dict[int, int] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._insert, args=(address, i, rows_per_call), daemon=True)
            for i in range(threads)
        ]
        self._threads.append(threading.Thread(target=self._sequences, args=(address,),
                                              daemon=True))
        for thread in self._threads:
            thread.start()

    def _insert(self, address: str, worker: int, n: int) -> None:
        client = ReplayClient(address, timeout=20)
        for call in range(MAX_CALLS):
            if self.stop.is_set():
                return
            tags = torch.arange(n) + (worker + 1) * 10**9 + call * n
            try:
                ids = client.insert("prioritized", rows(tags), priorities=torch.rand(n) + 0.1)
            except ReplayError as exc:
                self.errors.append(exc)
                return
            with self._lock:
                self.acked.update(zip(ids.tolist(), tags.tolist()))

    def _sequences(self, address: str) -> None:
        client = ReplayClient(address, timeout=20)
        for episode in range(MAX_CALLS):
            if self.stop.is_set():
                return
            tags = torch.arange(6) + episode * 6
            try:
                ids = client.insert("sequences", rows(tags, episode))
            except ReplayError as exc:
                self.errors.append(exc)
                return
            with self._lock:
                self.acked_sequences.update(zip(ids.tolist(), tags.tolist()))

    def count(self) -> int:
        with self._lock:
            return len(self.acked)

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.count() < count and time.monotonic() < deadline and not self.errors:
            time.sleep(0.01)
        assert self.count() >= count, (self.count(), self.errors)

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in self._threads)


def offline_tables(text: str) -> TableSet:
    import tomllib

    return TableSet(settings_from_dict(tomllib.loads(text)).tables)


def assert_tags_match(batch, acked: dict[int, int]) -> None:
    ids, tags = batch.ids.reshape(-1).tolist(), batch.data["tag"].reshape(-1).tolist()
    assert all(acked[i] == t for i, t in zip(ids, tags))


def test_kill_9_under_insert_load_restores_the_last_checkpoint_exactly(tmp_path: Path) -> None:
    text = config(tmp_path / "ckpt")
    server = start_server(tmp_path, text)
    load = Load(server.address)
    load.wait_for(2000)
    before = dict(load.acked)  # acknowledged before the checkpoint was asked for
    path = ReplayClient(server.address).checkpoint()
    load.wait_for(len(before) + 2000)  # more inserts after it, then a crash
    server.process.kill()
    server.process.wait(WAIT_S)
    load.join()
    assert all(isinstance(e, errors.UnavailableError) for e in load.errors), load.errors

    offline = offline_tables(text)
    load_checkpoint(Path(path), offline)
    again = start_server(tmp_path, text, name="again")
    try:
        client = ReplayClient(again.address)
        assert f"restored 2 table(s) from {path}" in again.log()
        info = client.info()
        for name in ("prioritized", "sequences"):
            expected = offline[name].info()
            assert info[name].size == expected.size > 0
            assert info[name].counters == {k: getattr(expected.counters, k)
                                           for k in info[name].counters}
            # Same rows, priorities, episode index and generator: the same next batch.
            got, want = client.sample(name, 64), offline[name].sample(64)
            assert torch.equal(got.ids, want.ids)
            assert torch.equal(got.probabilities, want.probabilities)
            assert torch.equal(got.weights, want.weights)
            assert torch.equal(got.data["tag"], want.data["tag"])
            assert torch.equal(got.data["obs"], want.data["obs"])
        assert_tags_match(client.sample("prioritized", 512), load.acked)
        assert_tags_match(client.sample("sequences", 64), load.acked_sequences)
        # Every insert acknowledged before the checkpoint was asked for is in it.
        ids = torch.tensor(sorted(before))
        assert client.update_priorities("prioritized", ids, torch.ones(len(ids))) == len(ids)
        # The ids acknowledged after the checkpoint's instant were lost in the crash:
        # updates for them are stale (ignored, counted), never an error, never applied.
        acked = torch.tensor(sorted(load.acked))
        saved = offline["prioritized"].size  # nothing was evicted: capacity 50,000
        assert len(acked) > saved + 1000
        stale_before = client.info()["prioritized"].counters["stale_priority_updates"]
        assert client.update_priorities("prioritized", acked, torch.ones(len(acked))) == saved
        stale = client.info()["prioritized"].counters["stale_priority_updates"] - stale_before
        assert stale == len(acked) - saved
        # And the server works, issuing ids no client was ever given before.
        new = client.insert("prioritized", rows(torch.arange(5) - 100))
        assert not set(new.tolist()) & set(load.acked)
        assert client.update_priorities("prioritized", new, torch.ones(5)) == 5
        assert client.sample("prioritized", 8).ids.shape == (8,)
    finally:
        again.stop()


def test_sigterm_under_load_keeps_every_acknowledged_insert(tmp_path: Path) -> None:
    text = config(tmp_path / "ckpt")
    server = start_server(tmp_path, text)
    load = Load(server.address)
    load.wait_for(3000)
    assert server.stop(signal.SIGTERM, timeout=WAIT_S) == 0
    load.join()
    assert all(isinstance(e, errors.UnavailableError) for e in load.errors), load.errors
    log = server.log()
    assert "SIGTERM received: draining" in log and "checkpoint (shutdown) written" in log

    again = start_server(tmp_path, text, name="again")
    try:
        client = ReplayClient(again.address)
        ids = torch.tensor(sorted(load.acked))
        assert client.update_priorities("prioritized", ids, torch.ones(len(ids))) == len(ids)
        seq_ids = torch.tensor(sorted(load.acked_sequences))
        assert client.info()["sequences"].counters["inserted"] >= len(seq_ids)
        assert client.info()["prioritized"].size >= len(ids)
        assert_tags_match(client.sample("prioritized", 1024), load.acked)
        assert_tags_match(client.sample("sequences", 64), load.acked_sequences)
    finally:
        again.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=WAIT_S, check=False)


def test_a_truncated_newest_checkpoint_is_skipped_with_the_reason_logged(tmp_path: Path) -> None:
    text = config(tmp_path / "ckpt")
    server = start_server(tmp_path, text)
    client = ReplayClient(server.address)
    client.insert("prioritized", rows(torch.arange(50)))
    older = client.checkpoint()
    client.insert("prioritized", rows(torch.arange(50, 100)))
    result = _cli("checkpoint", "--address", server.address)
    assert result.returncode == 0, result.stderr
    newest = result.stdout.strip()
    assert Path(newest).parent == Path(older).parent and newest != older
    server.process.kill()  # no final checkpoint
    server.process.wait(WAIT_S)
    column = Path(newest) / "prioritized" / "column-0.bin"
    with open(column, "r+b") as f:
        f.truncate(column.stat().st_size // 2)

    again = start_server(tmp_path, text, name="again")
    try:
        assert ReplayClient(again.address).info()["prioritized"].size == 50
        log = again.log()
        assert f"WARNING replay_server.checkpoint: skipping checkpoint {newest}: " in log, log
        assert "prioritized/column-0.bin is 1600 bytes but the manifest says 3200 " \
               "(truncated)" in log
        assert f"restored 2 table(s) from {older}" in log
    finally:
        again.stop()


FULL_DISK = {"rlimits": {"FSIZE": (1 << 20, -1)}, "ignore_sigxfsz": True}
"""In the server process: writes past 1 MiB fail with EFBIG (SIGXFSZ ignored), like a full
disk does with ENOSPC. Real, reliable, needs no privileges, and root (which ignores
permission bits) cannot bypass it; the test lifts it with prlimit."""


def test_a_full_disk_fails_the_checkpoint_clearly_and_the_server_keeps_serving(
    tmp_path: Path
) -> None:
    text = config(tmp_path / "ckpt")
    server = start_server(tmp_path, text, **FULL_DISK)
    try:
        client = ReplayClient(server.address)
        client.insert("prioritized", rows(torch.arange(40_000)))  # 1.6 MB of obs
        with pytest.raises(errors.CheckpointError) as info:
            client.checkpoint()
        message = str(info.value)
        assert "checkpoint failed writing" in message and "column-0.bin" in message
        assert "File too large (EFBIG)" in message and "keep serving" in message
        assert "checkpoint (Checkpoint RPC) failed: checkpoint failed writing" in server.log()
        assert sorted((tmp_path / "ckpt").iterdir()) == [tmp_path / "ckpt" / "INCARNATION",
                                                         tmp_path / "ckpt" / "LOCK"]
        # The server keeps serving.
        client.insert("prioritized", rows(torch.arange(10) + 10**6))
        assert client.sample("prioritized", 16).ids.shape == (16,)
        assert client.info()["prioritized"].size == 40_010
        # Once the cause is gone, the next checkpoint works.
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE,
                         (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        path = Path(client.checkpoint())
        assert path.is_dir() and (path / "COMPLETE").is_file()
    finally:
        server.stop()


def test_a_config_contradicting_the_checkpoint_stops_the_start_naming_both(
    tmp_path: Path
) -> None:
    server = start_server(tmp_path, config(tmp_path / "ckpt", capacity=1000))
    ReplayClient(server.address).insert("prioritized", rows(torch.arange(10)))
    assert server.stop(signal.SIGTERM) == 0  # writes the final checkpoint
    [checkpoint] = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("ckpt-")]
    contradicting = tmp_path / "contradicting.toml"
    contradicting.write_text(config(tmp_path / "ckpt", capacity=500))
    result = _cli("serve", "--config", str(contradicting), "--address", "127.0.0.1:0")
    assert result.returncode == 2, result.stderr
    assert "replay-server: configuration error: checkpoint " in result.stderr
    assert str(checkpoint) in result.stderr
    assert "table 'prioritized': config says capacity=500 but the saved state has " \
           "capacity=1000" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_checkpoint_dir_that_is_a_file_stops_the_start_naming_the_field(
    tmp_path: Path
) -> None:
    (tmp_path / "ckpt").write_text("not a directory")
    path = tmp_path / "config.toml"
    path.write_text(config(tmp_path / "ckpt"))
    result = _cli("serve", "--config", str(path), "--address", "127.0.0.1:0")
    assert result.returncode == 2, result.stderr
    assert f"server.checkpoint_dir: checkpoint directory '{tmp_path / 'ckpt'}' is not a " \
           "directory" in result.stderr


def test_checkpoints_are_written_on_a_timer_and_pruned(tmp_path: Path) -> None:
    server = start_server(tmp_path, config(tmp_path / "ckpt", interval=0.2, keep=2))
    try:
        ReplayClient(server.address).insert("prioritized", rows(torch.arange(10)))
        deadline = time.monotonic() + WAIT_S
        while server.log().count("checkpoint (timer) written") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.log().count("checkpoint (timer) written") >= 4
        complete = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("ckpt-")]
        assert 1 <= len(complete) <= 3  # keep 2, plus possibly one being written
    finally:
        server.stop()


def _health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _wait_health(address: str, wanted: str) -> None:
    deadline = time.monotonic() + WAIT_S
    status = None
    while time.monotonic() < deadline:
        status = _health(address)
        if status == wanted:
            return
        time.sleep(0.05)
    raise AssertionError(f"health stayed {status}, expected {wanted}")


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared")
        time.sleep(0.05)


def _start_blocking(tmp_path: Path, text: str, port: int, name: str,
                    release: Path, restore_stop_s: float | None = None) -> ServerProcess:
    """A server whose restore blocks reading column files until ``release`` exists (the
    port file only appears once SERVING); ``<name>.blocked`` appears in ``tmp_path``
    once a read is stuck. ``restore_stop_s``: the seconds a signalled restore has to stop
    (the server's ``RESTORE_STOP_S`` when None)."""
    stop_env = {} if restore_stop_s is None else {
        "REPLAY_TEST_RESTORE_STOP_S": str(restore_stop_s)}
    (tmp_path / f"{name}.toml").write_text(text)
    log_path = tmp_path / f"{name}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.stuck_disk_server", "serve", "--config",
         str(tmp_path / f"{name}.toml"), "--address", f"127.0.0.1:{port}", "--grace", "5"],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "REPLAY_TEST_RELEASE_FILE": str(release),
             "REPLAY_TEST_BLOCKED_FILE": str(tmp_path / f"{name}.blocked"), **stop_env})
    return ServerProcess(process, port, log_path)


def _two_checkpoints_then_kill(tmp_path: Path, text: str) -> tuple[str, Path]:
    """Start a server, write a checkpoint of 10 rows and a newer one of 20, kill -9 it;
    return both checkpoints (the older as the server named it)."""
    server = start_server(tmp_path, text)
    client = ReplayClient(server.address)
    client.insert("prioritized", rows(torch.arange(10)))
    older = client.checkpoint()
    client.insert("prioritized", rows(torch.arange(10, 20)))
    newest = Path(client.checkpoint())
    server.stop(signal.SIGKILL)
    return older, newest


def test_health_is_not_serving_and_calls_unavailable_until_the_restore_is_done(
    tmp_path: Path
) -> None:
    text = config(tmp_path / "ckpt")
    older, newest = _two_checkpoints_then_kill(tmp_path, text)
    column = newest / "prioritized" / "column-0.bin"
    column.write_bytes(b"")  # damaged: the restore falls back to the older checkpoint

    release = tmp_path / "release"
    port = free_port()
    blocked = _start_blocking(tmp_path, text, port, "blocked", release)
    try:
        _wait_health(blocked.address, "NOT_SERVING")
        with pytest.raises(errors.UnavailableError, match="restoring"):
            ReplayClient(blocked.address, max_retry_s=0).insert(
                "prioritized", rows(torch.arange(3)))
        release.touch()  # the disk answers again
        _wait_health(blocked.address, "SERVING")
        assert ReplayClient(blocked.address).info()["prioritized"].size == 10
        log = blocked.log()
        assert f"skipping checkpoint {newest}: prioritized/column-0.bin is 0 bytes" in log
        assert f"restored 2 table(s) from {older}" in log
    finally:
        blocked.process.kill()
        blocked.process.wait(WAIT_S)

    # A stop requested during a restore stuck in a read (never released) exits 0 and
    # writes no checkpoint.
    before = sorted((tmp_path / "ckpt").iterdir())
    stopped = _start_blocking(tmp_path, text, free_port(), "stopped", tmp_path / "never",
                              restore_stop_s=1.0)  # it never stops: waiting 5 s proves no more
    try:
        _wait_health(stopped.address, "NOT_SERVING")
        # the signal must find the restore inside the stuck read, not on its way to it
        # (there it stops by itself, and the warning below is rightly not logged)
        _wait_for_file(tmp_path / "stopped.blocked")
        stopped.process.send_signal(signal.SIGTERM)
        assert stopped.process.wait(WAIT_S) == 0
    finally:
        if stopped.process.poll() is None:
            stopped.process.kill()
    assert "stopped while restoring: no checkpoint written" in stopped.log()
    assert "the restore did not stop within" in stopped.log()
    assert sorted((tmp_path / "ckpt").iterdir()) == before


def test_a_fifo_in_place_of_a_column_file_is_refused_unread(tmp_path: Path) -> None:
    """Issue 23, finding 10: a FIFO in place of a column file hung the restore (opening it
    waits for a writer), deaf to SIGTERM. It is damage now, refused without reading."""
    text = config(tmp_path / "ckpt")
    older, newest = _two_checkpoints_then_kill(tmp_path, text)
    fifo = newest / "prioritized" / "column-0.bin"
    fifo.unlink()
    os.mkfifo(fifo)
    again = start_server(tmp_path, text, name="again")
    try:
        assert ReplayClient(again.address).info()["prioritized"].size == 10
        assert f"skipping checkpoint {newest}: prioritized/column-0.bin is not a regular " \
               f"file (a FIFO)" in again.log()
        assert f"restored 2 table(s) from {older}" in again.log()
    finally:
        assert again.stop() == 0


@pytest.fixture
def small_disk(tmp_path: Path):
    """Mount a tmpfs of a given size (MiB) under ``tmp_path``: a disk that really fills up.
    Skipped where this process may not mount (it needs CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(mib: int) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def memmap_config(checkpoints: Path, storage: Path, capacity: int = 30) -> str:
    return f"""
[server]
checkpoint_dir = "{checkpoints}"
checkpoint_interval_s = 0

[[tables]]
name = "disk"
capacity = {capacity}
storage = "memmap"
storage_dir = "{storage}"
[tables.schema]
obs = "uint8[1024, 1024]"
"""


def test_a_memmap_table_restores_in_place_on_a_disk_that_holds_one_copy(
        tmp_path: Path, small_disk) -> None:
    """Issue 23, finding 8: with a declared schema, a memmap table's restore needed a second
    copy on disk (a 150 MiB table on a 200 MiB disk could not restart). 30 MiB of rows on
    a 50 MiB disk restart now, the rows read straight into the table's own files."""
    disk = small_disk(50)
    text = memmap_config(tmp_path / "ckpt", disk)
    server = start_server(tmp_path, text)
    client = ReplayClient(server.address)
    client.insert("disk", {"obs": torch.arange(30, dtype=torch.uint8).view(30, 1, 1).expand(
        30, 1024, 1024).contiguous()})
    assert server.stop() == 0
    again = start_server(tmp_path, text, name="again")
    try:
        client = ReplayClient(again.address)
        assert client.info()["disk"].size == 30
        obs = client.sample("disk", 8).data["obs"]
        assert obs.shape == (8, 1024, 1024)
        assert all(bool((row == row[0, 0]).all()) and int(row[0, 0]) < 30 for row in obs)
    finally:
        assert again.stop() == 0


def test_a_disk_too_small_for_a_memmap_table_stops_the_start_naming_the_disk(
        tmp_path: Path, small_disk) -> None:
    disk = small_disk(20)
    code, output = serve_until_exit(tmp_path, memmap_config(tmp_path / "ckpt", disk))
    assert code == 2, output
    assert "replay-server: not enough memory or disk space: table 'disk': storage 'memmap' " \
           "needs 30.0 MiB on disk" in output and str(disk) in output
    assert "Traceback" not in output
