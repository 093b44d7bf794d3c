"""The test proxy itself: it forwards bytes in order, late by its delay, and stalls and resets."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.tools.proxy import LinkProxy


@pytest.fixture
def echo():
    """A TCP echo server on 127.0.0.1 (one thread per connection)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    listener.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:  # reset by the proxy: the test's point
            pass


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _round_trip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(65536)
    return got


def test_bytes_arrive_whole_in_order_and_late_by_the_delay(echo) -> None:
    with LinkProxy(echo, delay_s=0.05) as proxy:
        sock = _connect(proxy.address)
        payload = bytes(range(256)) * 4096  # 1 MiB
        start = time.monotonic()
        assert _round_trip(sock, payload) == payload
        assert time.monotonic() - start >= 2 * 0.05  # one delay each way, at least
        sock.close()


def test_a_stall_holds_the_bytes_until_resumed_and_a_reset_breaks_the_connection(echo) -> None:
    with LinkProxy(echo) as proxy:
        sock = _connect(proxy.address)
        assert _round_trip(sock, b"ping") == b"ping"
        proxy.stall()
        sock.sendall(b"held")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(16)  # nothing moves while stalled
        proxy.resume()
        sock.settimeout(10)
        assert sock.recv(16) == b"held"
        proxy.reset()
        with pytest.raises((ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            for _ in range(100):  # the first send may still be accepted locally
                sock.sendall(b"x" * 65536)
                if not sock.recv(65536):
                    raise ConnectionResetError("closed")
        sock.close()
        assert proxy.stats.resets == 1 and proxy.stats.connections == 1
