"""Servers started and stopped over and over by a process busy with gRPC calls: no aborts.

Issue 23, finding 9: ``ev_epoll1_linux.cc: epoll_wait error: Bad file
descriptor`` and SIGABRT, seen twice at server start under load. What
closed the descriptor: ``subprocess.Popen``'s ``close_fds``, in the forked
child of the test process, between ``fork`` and ``exec``. A ``preexec_fn``
(used to set a server's resource limits) makes Python fork rather than
vfork; the fork ran gRPC's fork handlers, which restarted gRPC's poller
thread in the child; ``close_fds`` then closed that poller's epoll
descriptor, and the poller aborted the child before it could ``exec`` the
server (reproduced: 3 starts in 40 under load). Servers are now given their
limits after ``exec`` (:mod:`tests.launch`), and Python spawns them with
vfork, which runs no fork handlers.

Each start here runs while client threads of this process keep calls in
flight to another server; starts rotate through no limit, a low open-file
limit and a full disk (a 1 MiB file-size limit), and each is checked to
serve, to stop with exit 0, and to have logged no poller error.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient, ReplayError
from tests.conftest import start_server

CONFIG = """
[server]
max_connections = 100
checkpoint_dir = "{directory}"
checkpoint_interval_s = 0

[[tables]]
name = "replay"
capacity = 1000
"""
VARIANTS = (
    {},
    {"rlimits": {"NOFILE": (256, 256)}},
    {"rlimits": {"FSIZE": (1 << 20, -1)}, "ignore_sigxfsz": True},
)
MAX_LOAD_CALLS = 1_000_000


class Load:
    """Client threads of this process keeping gRPC calls in flight to a server."""

    def __init__(self, address: str, threads: int = 3) -> None:
        self._stop = threading.Event()
        self.calls = 0
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(address,), daemon=True)
                         for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, address: str) -> None:
        client = ReplayClient(address, timeout=30)
        rows = {"x": torch.zeros(16, 8)}
        for _ in range(MAX_LOAD_CALLS):
            if self._stop.is_set():
                return
            try:
                client.insert("replay", rows)
                client.sample("replay", 8)
            except ReplayError as exc:
                self.errors.append(exc)
                return
            self.calls += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


@pytest.mark.parametrize("starts", [3, pytest.param(200, marks=pytest.mark.slow)])
def test_starting_servers_under_load_never_aborts_one(tmp_path: Path, starts: int) -> None:
    target = start_server(tmp_path, CONFIG.format(directory=tmp_path / "load"), name="load")
    load = Load(target.address)
    aborted: list[str] = []
    try:
        for i in range(starts):
            variant = VARIANTS[i % len(VARIANTS)]
            directory = tmp_path / f"run{i}"
            server = start_server(directory.parent, CONFIG.format(directory=directory),
                                  name=f"run{i}", **variant)
            ReplayClient(server.address).insert("replay", {"x": torch.zeros(4, 8)})
            code = server.stop()
            log = server.log()
            if code != 0 or "epoll_wait error" in log or "Bad file descriptor" in log:
                aborted.append(f"start {i} ({variant}): exit {code}\n{log[-2000:]}")
            server.log_path.unlink()
        calls = load.calls
    finally:
        load.stop()
        assert target.stop() == 0
    assert not aborted, "\n".join(aborted)
    assert not load.errors, load.errors
    assert calls > starts  # the load really ran throughout
