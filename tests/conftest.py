"""Shared fixtures: real server processes on 127.0.0.1."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Ray reads this when it is first imported, by whichever test that is (a client test resolving
# ray://, a doc block, the Ray cluster's): without it Ray 2.60 turns 127.0.0.1 into the host's
# address. Every Ray node a test starts stays on loopback (tests/server/ray/conftest.py checks).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# Ray waits 30 s for its GCS server to write its port file; on the CI machine with the image
# being built beside the suite, ray.init in docs/ray.md's first block once took longer and
# every later block of the doc failed with it. A loaded machine is slow, not broken.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

START_TIMEOUT_S = 60

# `make test` hands whole files to its workers (--dist loadfile, --no-loadscope-reorder), each
# taking the next file in collection order when it finishes one. The files that take minutes
# (few tests, each a cluster or a server's life) go first: left to the end, one of them kept a
# worker busy for minutes after the other had run out of files. Within a group files keep
# their order, and each file's tests stay together and in order.
LONG_FILES_FIRST = (
    "tests/server/ray/",
    "tests/test_docs.py",
    "tests/examples/",
    "tests/integration/",
    "tests/deploy/",
    "tests/conformance/",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def group(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((rank for rank, prefix in enumerate(LONG_FILES_FIRST)
                     if path.startswith(prefix)), len(LONG_FILES_FIRST))

    items.sort(key=group)  # stable: the order within a group is pytest's


@dataclass
class ServerProcess:
    """A ``replay-server serve`` subprocess listening on 127.0.0.1."""

    process: subprocess.Popen | Forked
    port: int
    log_path: Path
    config_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


def start_server(
    tmp_path: Path,
    config: str | None = None,
    *,
    port: int = 0,
    env: dict[str, str] | None = None,
    name: str = "server",
    rlimits: dict[str, tuple[int, int]] | None = None,
    ignore_sigxfsz: bool = False,
    extra_args: tuple[str, ...] = (),
    module: str = "replay_server.app.cli",
) -> ServerProcess:
    """Start ``replay-server serve`` (with ``config`` TOML text, if given) and wait for its port.

    The port file is written once the server is SERVING (tables restored).
    ``rlimits`` (``{"NOFILE": (1024, 1024)}``; -1: unlimited) and
    ``ignore_sigxfsz`` are applied in the server process after ``exec``, by
    :mod:`tests.launch` (never a ``preexec_fn``: forking a process that holds
    gRPC channels aborts the child, see there); ``extra_args`` are added to its
    command line; ``module`` is the module run with ``python -m`` (a test's
    launcher that prepares the process first).
    """
    port_file = tmp_path / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log_path = tmp_path / f"{name}.log"
    launch: list[str] = []
    for limit, (soft, hard) in (rlimits or {}).items():
        launch += ["--rlimit", f"{limit}={soft}:{hard}"]
    if ignore_sigxfsz:
        launch.append("--ignore-sigxfsz")
    prefix = ["-m", "tests.launch", *launch, module] if launch else ["-m", module]
    args = [sys.executable, *prefix, "serve",
            "--address", f"127.0.0.1:{port}", "--port-file", str(port_file), "--grace", "5"]
    config_path = None
    if config is not None:
        config_path = tmp_path / f"{name}.toml"
        config_path.write_text(config)
        args += ["--config", str(config_path)]
    args += list(extra_args)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = _spawn(args, log_path, full_env,
                     spare=not launch and module == "replay_server.app.cli")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return ServerProcess(process, int(port_file.read_text()), log_path, config_path,
                                 env or {})
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"server did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()}")


class _Zygote:
    """One ``python -m tests.spare`` process per test worker that has imported the server's
    modules once and forks each plain server start (see :mod:`tests.spare`).

    A start with the plain command line (no ``rlimits``, no other ``module``, no extra
    ``env``) is forked from it while the environment and working directory are still the
    zygote's (else a new zygote is started for them); any other start is a cold start.
    The server is the zygote's child, not this process's: :class:`Forked` stands in for
    its ``Popen``, its exit status told by the zygote. ``REPLAY_TEST_SPARES=0`` turns it
    off. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one order at a time, and the zygote's (re)start
        self._process: subprocess.Popen | None = None
        self._prelude = ""
        self._env: dict[str, str] = {}
        self._cwd = ""
        self._replies: queue.Queue[int | None] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._gone: set[int] = set()  # children of a zygote that ended before they did
        self._changed = threading.Condition()
        self._enabled = os.environ.get("REPLAY_TEST_SPARES", "1") != "0"
        atexit.register(self.close)

    def take(self, args: list[str], log_path: Path, env: dict[str, str]) -> Forked | None:
        """A server forked to run ``args`` into ``log_path``; None: start it cold."""
        plain = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not self._enabled or env != plain:
            return None
        with self._lock:
            if self._process is None or _unlike(self._env, env) or self._cwd != os.getcwd():
                self._stop()
                if not self._start(env):
                    return None
            assert self._process is not None and self._process.stdin is not None
            order = json.dumps({"args": args, "log": str(log_path)})
            try:
                self._process.stdin.write(order.encode() + b"\n")
                self._process.stdin.flush()
                pid = self._replies.get(timeout=START_TIMEOUT_S)
            except (OSError, queue.Empty):
                pid = None
            if pid is None:
                self._stop()
                return None
        return Forked(self, pid, args)

    def _start(self, env: dict[str, str]) -> bool:
        descriptor, self._prelude = tempfile.mkstemp(prefix="replay-zygote-", suffix=".log")
        self._env, self._cwd = env, os.getcwd()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.spare", self._prelude], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=descriptor, env=env)
        finally:
            os.close(descriptor)
        assert process.stdout is not None
        if process.stdout.readline() != b"ready\n":
            process.kill()
            process.wait()
            return False
        self._process = process
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(process, self._replies), daemon=True,
                         name="zygote-reader").start()
        return True

    def _read(self, process: subprocess.Popen, replies: queue.Queue) -> None:
        """The zygote's lines: a forked child's pid (to the order waiting), a child's exit."""
        assert process.stdout is not None
        children: set[int] = set()
        for line in process.stdout:
            kind, *values = line.decode().split()
            if kind == "pid":
                children.add(int(values[0]))
                replies.put(int(values[0]))
            elif kind == "exit":
                with self._changed:
                    children.discard(int(values[0]))
                    self._exits[int(values[0])] = int(values[1])
                    self._changed.notify_all()
        replies.put(None)
        with self._changed:  # the zygote ended: its children left are nobody's to reap
            self._gone |= children
            self._changed.notify_all()

    def status(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """The exit status of forked child ``pid``, waiting up to ``timeout`` (None: for
        ever) for it; None: still running. If its zygote died first no status can come:
        a child gone since reads as killed (``-SIGKILL``), one still running as None."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or pid in self._gone, timeout)
            if pid in self._exits:
                return self._exits[pid]
        if pid in self._gone:  # no status will come: it is running or it is not
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -signal.SIGKILL
        return None

    def _stop(self, wait_s: float = 0.5) -> None:
        process, self._process = self._process, None
        if process is not None and process.stdin is not None:
            process.stdin.close()  # no more orders: it exits once its children have
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass  # it still reaps children serving; it exits after them
        if self._prelude:
            Path(self._prelude).unlink(missing_ok=True)
            self._prelude = ""

    def close(self) -> None:
        with self._lock:
            self._stop(wait_s=10.0)  # at exit: the tests have stopped their servers


class Forked:
    """The ``Popen`` of a server forked by the zygote: ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate`` and ``kill`` as ``subprocess.Popen``'s."""

    def __init__(self, zygote: _Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _unlike(spare: dict[str, str], wanted: dict[str, str]) -> bool:
    """Whether two environments differ beyond ``PYTEST_CURRENT_TEST`` (pytest sets it per test)."""
    ignored = "PYTEST_CURRENT_TEST"
    return ({k: v for k, v in spare.items() if k != ignored}
            != {k: v for k, v in wanted.items() if k != ignored})


_ZYGOTE = _Zygote()


def _spawn(args: list[str], log_path: Path, env: dict[str, str], *,
           spare: bool) -> subprocess.Popen | Forked:
    """The server command ``args``, its output appended to ``log_path``: forked by the
    zygote when ``spare`` (a plain ``replay_server.app.cli`` start) and it fits (see
    :class:`_Zygote`), else started cold."""
    process = _ZYGOTE.take(args[3:], log_path, env) if spare else None
    if process is None:
        with log_path.open("a") as log_file:
            return subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    return process


def serve_until_exit(tmp_path: Path, config: str, *, extra_args: tuple[str, ...] = (),
                     timeout: float = START_TIMEOUT_S) -> tuple[int, str]:
    """Run ``replay-server serve --config`` expecting it to stop on its own (a start-up error).

    Returns its exit code and output. A server that starts serving instead is
    stopped and reported as a test failure.
    """
    config_path = tmp_path / "exits.toml"
    config_path.write_text(config)
    port_file = tmp_path / "exits.port"
    port_file.unlink(missing_ok=True)
    log_path = tmp_path / "exits.log"
    log_path.unlink(missing_ok=True)
    args = [sys.executable, "-m", "replay_server.app.cli", "serve", "--address", "127.0.0.1:0",
            "--config", str(config_path), "--port-file", str(port_file), *extra_args]
    process = _spawn(args, log_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, spare=True)
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline and not port_file.exists():
        time.sleep(0.05)
    if process.poll() is None:
        process.kill()
        process.wait()
        pytest.fail(f"the server did not stop on its own (it started serving):\n"
                    f"{log_path.read_text()}")
    return process.returncode, log_path.read_text()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def run_threads(target, count: int, timeout: float) -> None:
    """Run ``target`` on ``count`` threads at once and wait for all of them (bounded)."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s"


def stays(predicate, seconds: float = 0.5, interval: float = 0.02) -> bool:
    """Whether ``predicate`` holds throughout ``seconds`` (False the moment it fails).

    How a test proves a negative: it waits for the violation with a deadline,
    failing as soon as it happens, after a positive event showed the system
    had every chance to act.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(interval)
    return bool(predicate())


def grpc_calls_only():
    """A module-scoped autouse fixture: clients made in the module send large inserts as
    chunked calls and make their samples as ``Sample`` calls, never through a call
    stream's shared-memory region (``REPLAY_SHARED_MEMORY=0``), as a client on another host
    does: for tests of the gRPC paths and their budgets. Assign it in the module
    (``_grpc = grpc_calls_only()``)."""

    @pytest.fixture(scope="module", autouse=True)
    def fixture() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("REPLAY_SHARED_MEMORY", "0")
            yield

    return fixture


def module_server(config: str | None, **kwargs):
    """A module-scoped fixture serving ``config`` (one server shared by a module's tests)."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory) -> Iterator[ServerProcess]:
        proc = start_server(tmp_path_factory.mktemp("server"), config, **kwargs)
        yield proc
        proc.stop()

    return fixture


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server with the default tables (small capacity is not configurable here)."""
    proc = start_server(tmp_path)
    yield proc
    proc.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    """Start servers with a given config; all are stopped at the end."""
    started: list[ServerProcess] = []

    def make(config: str | None = None, **kwargs) -> ServerProcess:
        proc = start_server(tmp_path, config, name=f"server{len(started)}", **kwargs)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()

