"""Idle connections cannot lock everyone out: ~1,000 idle sockets against a real server;
calls over ``max_concurrent_calls`` are refused before they are read.

Issue 10, finding 6: about 1,010 idle TCP sockets, at the usual 1,024
open-file limit, made every new connection (health checks included) time
out for as long as they were held. Now connections beyond
``max_connections`` are closed at once, and a connection that has not
finished its HTTP/2 handshake (or has no call) is closed after the idle
timeout, so the server's descriptors stay bounded and health checks are
answered again within the timeout even while the attacker holds its sockets.

The server runs with the usual limit of 1,024 open files; the test opens
up to 1,000 sockets, fewer if its own open-file limit is lower.
"""

from __future__ import annotations

import re
import resource
import socket
import threading
import time
import urllib.request

from collections.abc import Iterator

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_client import ReplayClient, errors
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, start_server, stays, wait_for
from tests.integration.raw_http2 import RawConnection

IDLE_S = 2
CALLS = 20
ANSWER_S = 3
CONFIG = f"""
[server]
idle_timeout_s = {IDLE_S}
max_connections = 500
max_concurrent_calls = {CALLS}
response_timeout_s = {ANSWER_S}

[[tables]]
name = "big"
capacity = 100

[[tables]]
name = "replay"
capacity = 100

[[tables]]
name = "gate"
capacity = 100
min_size_to_sample = 50
"""


USUAL_OPEN_FILE_LIMIT = {"NOFILE": (1024, 1024)}


def _idle_sockets_we_can_open() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1000 + 100
    if soft < want:
        soft = min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return min(1000, soft - 100)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def _closed_by_server(sockets: list[socket.socket]) -> int:
    closed = 0
    for sock in sockets:
        sock.setblocking(False)  # (with a timeout set, MSG_DONTWAIT would wait for it)
        try:
            while sock.recv(65536):  # what the server sent before closing (its SETTINGS)
                pass
            closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("limits"), CONFIG,
                        rlimits=USUAL_OPEN_FILE_LIMIT)
    yield proc
    proc.stop()


def test_calls_over_max_concurrent_calls_are_refused_and_unread_answers_are_dropped(
        server) -> None:
    """Calls whose answers a client never reads hold working slots and memory: over
    max_concurrent_calls the next call is refused before it is read, naming the limit.
    Issue 23, finding 10: such answers were held for good (720 MiB, samples refused); now
    one not taken within response_timeout_s is dropped, freeing its slot and memory."""
    client = ReplayClient(server.address, timeout=10, max_retry_s=0)
    client.insert("big", {"x": torch.zeros(100, 16384)})  # rows of 64 KiB
    before = client.server_info().limits["memory_in_use_bytes"]
    reader = RawConnection(server.port)
    assert reader.handshake()
    request = pb.SampleRequest(table="big", batch_size=64).SerializeToString()  # 4 MiB
    for _ in range(CALLS):  # answers HTTP/2 flow control holds: the client reads nothing
        reader.call("/replay.v1.ReplayService/Sample", request)

    def refused() -> bool:
        try:
            client.info()
        except errors.OverloadedError as exc:
            assert "server.max_concurrent_calls = 20" in str(exc)
            return True
        return False

    try:
        assert wait_for(refused, timeout=10)
        assert _serving(server.address)  # health checks are not replay calls: never refused
        started = time.monotonic()
        assert wait_for(lambda: not refused(), timeout=ANSWER_S + 20)
        assert time.monotonic() - started >= ANSWER_S * 0.5
        assert wait_for(lambda: client.server_info().limits["calls_in_flight"] == 1)  # itself
        limits = client.server_info().limits
        assert limits["memory_in_use_bytes"] <= before + (1 << 20)  # the answers' memory
        assert limits["calls_waiting"] == 0
        assert client.sample("big", 64).data["x"].shape == (64, 16384)
    finally:
        reader.close()


def test_a_thousand_idle_sockets_do_not_lock_out_health_checks_or_clients(server) -> None:
    process = psutil.Process(server.process.pid)
    count = _idle_sockets_we_can_open()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):  # connect and never say a word
            sockets.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        peak_fds = [process.num_fds()]
        sampling = threading.Event()

        def sample_fds() -> None:
            while not sampling.is_set():
                peak_fds[0] = max(peak_fds[0], process.num_fds())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample_fds, daemon=True)
        sampler.start()
        started = time.monotonic()
        # While the attacker holds every socket, the server answers again within the idle
        # timeout (plus a generous margin for a shared machine) ...
        assert wait_for(lambda: _serving(server.address), timeout=IDLE_S + 15)
        assert time.monotonic() - started < IDLE_S + 15
        client = ReplayClient(server.address, timeout=10)
        client.insert("replay", {"x": torch.zeros(4)})
        assert client.info()["replay"].size == 4
        # ... because it closed the connections it had taken (beyond max_connections it takes
        # none: they wait in the kernel's accept queue, costing it no descriptor) ...
        assert wait_for(lambda: _closed_by_server(sockets) >= min(count, 500),
                        timeout=IDLE_S + 15)
        assert wait_for(lambda: process.num_fds() < 100, timeout=IDLE_S + 15)
        # ... and never held more descriptors than max_connections allows.
        sampling.set()
        sampler.join(10)
        assert peak_fds[0] <= 500 + 64
        assert server.process.poll() is None
    finally:
        for sock in sockets:
            sock.close()


# ---------------------------------------------------------------- issue 23, findings 3 and 4

ATTACK_S = 6.0
LOCKOUT_BOUND_S = 0.5
ATTACK_CONNECTIONS = 3000
HANDSHAKE_S = 1.0
PER_HOST = 8
GUARDED = f"""
[server]
auth_token_env = "REPLAY_TEST_TOKEN"
handshake_timeout_s = {HANDSHAKE_S}
max_idle_connections_per_host = {PER_HOST}
max_connections = 200
health_address = "127.0.0.1:0"
metrics_address = "127.0.0.1:0"
checkpoint_dir = "{{directory}}"
checkpoint_interval_s = 0.5

[[tables]]
name = "replay"
capacity = 100
"""
TOKEN = "guard-token"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp_path = tmp_path_factory.mktemp("guarded")
    proc = start_server(tmp_path, GUARDED.format(directory=tmp_path / "ckpt"),
                        env={"REPLAY_TEST_TOKEN": TOKEN}, rlimits=USUAL_OPEN_FILE_LIMIT)
    yield proc
    proc.stop()


def _side_ports(server: ServerProcess) -> tuple[int, int]:
    """The health and metrics ports, from the server's start-up log."""
    log = server.log()
    health = re.search(r"health checks \(plaintext.*\) on 127\.0\.0\.1:(\d+)", log)
    metrics = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log)
    assert health and metrics, log
    return int(health.group(1)), int(metrics.group(1))


class Probe:
    """A legitimate client calling the server over a fresh connection every few tens of
    milliseconds, recording how long it was locked out (failed calls end to end)."""

    def __init__(self, address: str, token: str | None = TOKEN) -> None:
        self._address = address
        self._token = token
        self.calls = 0
        self.failures: list[str] = []
        self.lockout_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing_since = None
        while not self._stop.is_set() and self.calls < 10_000:
            client = ReplayClient(self._address, token=self._token, timeout=2, max_retry_s=0)
            try:
                client.info()
                if failing_since is not None:
                    self.lockout_s += time.monotonic() - failing_since
                    failing_since = None
            except errors.ReplayError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                if failing_since is None:
                    failing_since = time.monotonic()
            finally:
                client.close()
                self.calls += 1
            self._stop.wait(0.02)
        if failing_since is not None:
            self.lockout_s += time.monotonic() - failing_since

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)


def _hold_idle_connections(port: int, source: str, until: float, held: list,
                           most: int = ATTACK_CONNECTIONS) -> None:
    """Open handshaked connections that make no call, as fast as possible, until ``until``
    (at most ``most``)."""
    for _ in range(most):
        if time.monotonic() >= until:
            return
        try:
            connection = RawConnection(port, source=source, timeout=2)
            connection.handshake()
        except OSError:
            continue
        held.append(connection)


def test_idle_connections_from_one_address_lock_no_one_out(guarded) -> None:
    """600 handshaked connections that make no call made the port UNAVAILABLE for
    idle_timeout_s (300 s), renewably, without a token. Now they are closed past a few per
    address and after the handshake deadline; a client calling meanwhile is never locked out."""
    process = psutil.Process(guarded.process.pid)
    probe = Probe(guarded.address)
    held: list[RawConnection] = []
    until = time.monotonic() + ATTACK_S
    attacker = threading.Thread(target=_hold_idle_connections,
                                args=(guarded.port, "127.0.0.2", until, held))
    peak = [0]
    attacker.start()
    while attacker.is_alive():
        peak[0] = max(peak[0], process.num_fds())
        time.sleep(0.05)
    attacker.join()
    probe.stop()
    try:
        print(f"{len(held)} idle connections from one address in {ATTACK_S:.0f} s; "
              f"{probe.calls} calls, {len(probe.failures)} failed, locked out "
              f"{probe.lockout_s:.2f} s; peak descriptors {peak[0]}")
        assert len(held) >= 200  # the attacker did fill the port's 200 connections, often
        # Target 0 (measured 0.00 s on an idle machine: docs/service.md); a shared machine
        # may delay the guard's thread past a burst once in a while.
        assert probe.calls >= 20 and probe.lockout_s <= LOCKOUT_BOUND_S, probe.failures
        assert wait_for(lambda: sum(c.closed_by_server() for c in held) >= len(held) - PER_HOST,
                        timeout=HANDSHAKE_S + 15)
        assert wait_for(lambda: sum(not c.closed_by_server() for c in held) == 0,
                        timeout=HANDSHAKE_S + 15)  # the last few: after the deadline
    finally:
        for connection in held:
            connection.close()


def test_without_the_token_no_connection_outlives_the_handshake_deadline(guarded) -> None:
    idle = RawConnection(guarded.port, source="127.0.0.3")
    assert idle.handshake()
    refused = RawConnection(guarded.port, source="127.0.0.4")
    assert refused.handshake()
    refused.call("/replay.v1.ReplayService/Info", b"")  # no token: refused, not a call
    health = RawConnection(guarded.port, source="127.0.0.5")
    assert health.handshake()
    health.call("/grpc.health.v1.Health/Check", b"")  # needs no token, proves nothing
    client = ReplayClient(guarded.address, token=TOKEN)
    client.info()
    started = time.monotonic()
    try:
        assert wait_for(lambda: all(c.closed_by_server() for c in (idle, refused, health)),
                        timeout=HANDSHAKE_S + 15)
        assert time.monotonic() - started >= HANDSHAKE_S * 0.5
        assert stays(lambda: client.info() is not None, HANDSHAKE_S * 2)
    finally:
        for connection in (idle, refused, health):
            connection.close()


def test_idle_sockets_on_health_and_metrics_take_no_descriptors_from_clients(guarded) -> None:
    """~1,000 idle sockets on the health listener and /metrics (no limit, a thread per
    /metrics connection) used up the server's 1,024 descriptors: clients were locked out
    and timed checkpoints failed with EMFILE. Each listener now holds a few connections."""
    health_port, metrics_port = _side_ports(guarded)
    process = psutil.Process(guarded.process.pid)
    written = guarded.log().count("checkpoint (timer) written")
    count = _idle_sockets_we_can_open()
    sockets: list[socket.socket] = []
    try:
        for i in range(count):
            port = metrics_port if i % 2 else health_port
            try:
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                pass
        assert len(sockets) >= count // 2
        print(f"{len(sockets)} idle sockets on health and /metrics: server descriptors "
              f"{process.num_fds()}")
        assert process.num_fds() < 200 + 64 + 32 + 64  # bounded: nowhere near 1,024
        client = ReplayClient(guarded.address, token=TOKEN, timeout=10)
        client.insert("replay", {"x": torch.zeros(4)})
        assert client.checkpoint()
        assert wait_for(lambda: guarded.log().count("checkpoint (timer) written") >= written + 2)
        assert "Too many open files" not in guarded.log()
        assert _serving(guarded.address)
    finally:
        for sock in sockets:
            sock.close()
    assert wait_for(_scraped(metrics_port), timeout=30)  # scrapes are served again at once


def _refused(address: str) -> bool:
    try:
        ReplayClient(address, timeout=2, max_retry_s=0).info()
    except errors.UnavailableError:
        return True
    return False


def _scraped(port: int):
    def scrape() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return b"replay_table_size_rows" in reply.read()
        except OSError:
            return False
    return scrape


def test_health_on_every_listener_says_not_serving_while_the_port_is_full(tmp_path) -> None:
    """health_address answered SERVING while the main port refused every new client."""
    config = """
[server]
max_connections = 6
max_idle_connections_per_host = 6
health_address = "127.0.0.1:0"

[[tables]]
name = "replay"
capacity = 100
"""
    server = start_server(tmp_path, config)
    clients: list[RawConnection] = []
    try:
        health_port = int(re.search(r"health checks \(plaintext.*\) on 127\.0\.0\.1:(\d+)",
                                    server.log()).group(1))
        health_address = f"127.0.0.1:{health_port}"
        assert _serving(health_address)
        for i in range(6):  # clients that made calls fill the port (they are kept)
            client = RawConnection(server.port, source=f"127.0.0.{10 + i}")
            assert client.handshake()
            client.call("/replay.v1.ReplayService/Info", b"")
            assert client.answered()
            clients.append(client)
        assert wait_for(lambda: not _serving(health_address), timeout=10), server.log()
        assert wait_for(lambda: _refused(server.address), timeout=10), server.log()
        for client in clients:
            client.close()
        assert wait_for(lambda: _serving(health_address), timeout=10)
    finally:
        server.stop()


@pytest.mark.slow
def test_the_reported_idle_connection_attack_at_full_size(tmp_path) -> None:
    """The report's size against the default limits: waves of 600 handshaked connections
    that make no call, from one address, renewed for a minute."""
    server = start_server(tmp_path, "[[tables]]\nname = \"replay\"\ncapacity = 100\n",
                          rlimits=USUAL_OPEN_FILE_LIMIT)
    held: list[RawConnection] = []
    probe = Probe(server.address, token=None)
    try:
        until = time.monotonic() + 60
        while time.monotonic() < until and len(held) < 60_000:
            wave: list[RawConnection] = []
            _hold_idle_connections(server.port, "127.0.0.2", min(until, time.monotonic() + 5),
                                   wave, 600)
            held.extend(wave)
            for connection in held[:-600]:
                connection.close()
            del held[:-600]
        probe.stop()
        print(f"idle-connection waves for 60 s: {probe.calls} calls, {len(probe.failures)} "
              f"failed, locked out {probe.lockout_s:.2f} s")
        assert probe.calls >= 100 and probe.lockout_s <= LOCKOUT_BOUND_S, probe.failures
        assert server.process.poll() is None
    finally:
        probe.stop()
        for connection in held:
            connection.close()
        assert server.stop() == 0
