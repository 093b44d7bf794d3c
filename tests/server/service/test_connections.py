"""ConnectionGuard: which connections it closes, on real sockets of this process."""

from __future__ import annotations

import socket
import time

import pytest

from replay_server.service import connections
from replay_server.service.connections import ConnectionGuard
from replay_server.service.peer_address import peer_address
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(not ConnectionGuard.supported(), reason="needs /proc/self/fd")


def test_peer_strings_are_parsed_and_mapped_addresses_normalised() -> None:
    assert peer_address("ipv4:10.0.0.7:53412") == ("10.0.0.7", 53412)
    assert peer_address("ipv6:[::1]:5") == ("::1", 5)
    assert peer_address("ipv6:[::ffff:127.0.0.1]:9") == ("127.0.0.1", 9)
    assert peer_address("unix:/tmp/sock") is None


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def accepted(listener: socket.socket, source: str) -> tuple[socket.socket, socket.socket]:
    client = socket.socket()
    client.bind((source, 0))
    while client.getsockname()[1] == listener.getsockname()[1]:
        # Another address may be given the listener's port number: the guard (looking at
        # every socket of this process on that port) would count the client as a connection.
        client.close()
        client = socket.socket()
        client.bind((source, 0))
    client.connect(listener.getsockname())
    conn, _ = listener.accept()
    return client, conn


def closed(client: socket.socket) -> bool:
    client.setblocking(False)
    try:
        return client.recv(1) == b""
    except BlockingIOError:
        return False


# Clock values where ``(t + GRACE_S) - t < GRACE_S`` in floating point (4400.19: by 3.7e-13;
# the host's uptime in [256, 1024) s and [4096, 16384) s gave such values), and this clock.
CLOCKS = [4400.19, 300.07, 9000.33, 2.0**20 + 0.01, None]


@pytest.mark.parametrize("clock", CLOCKS, ids=lambda c: "now" if c is None else repr(c))
def test_it_closes_by_deadline_and_per_host_cap_keeping_callers(listener, clock) -> None:
    port = listener.getsockname()[1]
    guard = ConnectionGuard(port, handshake_timeout_s=5, max_idle_per_host=2, max_idle=100,
                            max_connections=100)
    try:
        pairs = [accepted(listener, "127.0.0.2") for _ in range(4)]
        caller = accepted(listener, "127.0.0.3")
        guard.called(f"ipv4:127.0.0.3:{caller[0].getsockname()[1]}")
        now = time.monotonic() if clock is None else clock
        assert guard.sweep(now) == 0  # young: spared by the caps (no pressure)
        assert guard.sweep(now + connections.GRACE_S) == 2  # two over the per-host cap: the oldest
        assert [closed(client) for client, _ in pairs] == [True, True, False, False]
        assert guard.sweep(now + 5) == 2  # exactly the deadline: the rest without a call
        assert all(closed(client) for client, _ in pairs)
        assert not closed(caller[0])  # it made a call: left to gRPC's idle timeout
        assert guard.closed == 4 and guard.open == 1
    finally:
        guard.stop()
        for client, conn in [*pairs, caller]:
            client.close()
            conn.close()


def test_a_sweep_that_cannot_list_descriptors_forgets_no_call(listener, monkeypatch) -> None:
    """Listing /proc/self/fd takes a descriptor, so at the open-file limit it fails. The guard
    took that for "no connection open": every connection came back new at the next sweep,
    its call forgotten, and was shut at the deadline (a learner's stream, making no new
    call, cut in the middle of an attack that filled the descriptors)."""
    port = listener.getsockname()[1]
    guard = ConnectionGuard(port, handshake_timeout_s=5, max_idle_per_host=10, max_idle=100,
                            max_connections=100)
    caller = accepted(listener, "127.0.0.3")
    try:
        guard.called(f"ipv4:127.0.0.3:{caller[0].getsockname()[1]}")
        now = time.monotonic()
        assert guard.sweep(now) == 0 and guard.open == 1
        real_listdir = connections.os.listdir

        def no_descriptor_left(path):
            raise OSError(24, "Too many open files", path)

        monkeypatch.setattr(connections.os, "listdir", no_descriptor_left)
        assert guard.sweep(now + 1) == 0  # nothing learned: nothing forgotten
        monkeypatch.setattr(connections.os, "listdir", real_listdir)
        assert guard.sweep(now + 2) == 0
        assert guard.sweep(now + 60) == 0  # long past the deadline: its call still counts
        assert not closed(caller[0]) and guard.open == 1
    finally:
        guard.stop()
        caller[0].close()
        caller[1].close()


def test_the_global_cap_and_fullness(listener) -> None:
    port = listener.getsockname()[1]
    seen: list[bool] = []
    guard = ConnectionGuard(port, handshake_timeout_s=5, max_idle_per_host=10, max_idle=3,
                            max_connections=5, on_full=seen.append)
    try:
        pairs = [accepted(listener, f"127.0.0.{10 + i}") for i in range(5)]
        assert guard.sweep() == 2 and seen == [True]  # full (pressed): 3 kept at once
        assert guard.sweep() == 0 and guard.open == 3
        for _, conn in pairs[:2]:  # what gRPC does with a connection shut down under it
            conn.close()
        assert guard.sweep() == 0 and seen == [True, False]
    finally:
        guard.stop()
        for client, conn in pairs:
            client.close()
            conn.close()


def test_it_never_closes_a_descriptor_it_does_not_own(listener) -> None:
    port = listener.getsockname()[1]
    guard = ConnectionGuard(port, handshake_timeout_s=0.1, max_idle_per_host=1, max_idle=1,
                            max_connections=100)
    try:
        pairs = [accepted(listener, "127.0.0.2") for _ in range(3)]
        now = time.monotonic()
        guard.sweep(now)
        guard.sweep(now + 1)  # the two oldest: over the cap of one per host; the newest: past
        guard.sweep(now + 1)  # the deadline
        for _, conn in pairs:
            conn.settimeout(10)  # the server's descriptors stay open: only shut down
            assert conn.fileno() >= 0 and conn.recv(1) == b""
    finally:
        guard.stop()
        for client, conn in pairs:
            client.close()
            conn.close()


def test_its_thread_sweeps_as_soon_as_connections_arrive(listener, monkeypatch) -> None:
    """Sweeping every 100 ms let a burst of 256 connections fill a 512-connection port between
    two sweeps (clients refused for ~1 s in a minute of attack waves). The thread now sweeps
    as soon as the process holds more descriptors than at its last sweep: with the periodic
    sweep out of the way (a minute), a burst over the caps is still trimmed."""
    monkeypatch.setattr(connections, "SWEEP_S", 60.0)
    port = listener.getsockname()[1]
    guard = ConnectionGuard(port, handshake_timeout_s=30, max_idle_per_host=2, max_idle=100,
                            max_connections=8)
    guard.start()
    pairs = []
    try:
        assert wait_for(lambda: guard.open == 0 and guard.closed == 0, timeout=10)
        pairs = [accepted(listener, "127.0.0.2") for _ in range(6)]  # under pressure: 6 of 8
        assert wait_for(lambda: guard.closed == 4, timeout=10)
        assert [closed(client) for client, _ in pairs] == [True] * 4 + [False] * 2
    finally:
        guard.stop()
        for client, conn in pairs:
            client.close()
            conn.close()
