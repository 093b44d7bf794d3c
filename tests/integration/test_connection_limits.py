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

import resource
import socket
import threading
import time

from collections.abc import Iterator

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, start_server, wait_for

IDLE_S = 2
CALLS = 20
CONFIG = f"""
[server]
idle_timeout_s = {IDLE_S}
max_connections = 500
max_concurrent_calls = {CALLS}

[[tables]]
name = "replay"
capacity = 100

[[tables]]
name = "gate"
capacity = 100
min_size_to_sample = 50
"""


def _usual_open_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


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
        try:
            if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("limits"), CONFIG,
                        preexec_fn=_usual_open_file_limit)
    yield proc
    proc.stop()


def test_calls_over_max_concurrent_calls_are_refused_unread_naming_the_limit(server) -> None:
    waiting = ReplayClient(server.address, timeout=3)
    errors_seen: list[BaseException] = []

    def blocked_sample() -> None:
        try:
            waiting.sample("gate", 1)  # held back by the rate limiter until its deadline
        except BaseException as exc:  # every one ends with DEADLINE_EXCEEDED
            errors_seen.append(exc)

    threads = [threading.Thread(target=blocked_sample) for _ in range(CALLS)]
    for thread in threads:
        thread.start()
    extra = ReplayClient(server.address, timeout=10, max_retry_s=0)

    def refused() -> bool:
        try:
            extra.info()
        except errors.OverloadedError as exc:
            assert "server.max_concurrent_calls = 20" in str(exc)
            return True
        return False

    assert wait_for(refused, timeout=10)
    assert _serving(server.address)  # health checks are not replay calls: never refused
    for thread in threads:
        thread.join(30)
    assert len(errors_seen) == CALLS
    assert all(isinstance(e, errors.DeadlineExceededError) for e in errors_seen), errors_seen
    assert extra.server_info().limits["calls_in_flight"] == 1  # this Info call itself


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
