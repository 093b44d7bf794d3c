"""HTTP/2 frame floods on one connection (issue 34, item 3), from a bare HTTP/2 client on
127.0.0.5, while a real client on 127.0.0.1 keeps calling: the legitimate client sees no
error, the server's memory stays bounded, and the floods that cost the server work cost
the flooder its connection.

* Rapid reset (HEADERS then RST_STREAM, over and over): gRPC (1.85) bounds the streams
  open at once, not the rate, and each reset stream still starts a handler; the server
  cuts a connection that ends more than ``server.max_call_resets_per_s`` calls within a
  second before their first message (``reset_meter``).
* PING: gRPC's own limit (pings faster than the keepalive floor get GOAWAY
  ``too_many_pings``).
* Empty DATA frames on a call: gRPC closes the connection.
* SETTINGS: gRPC acknowledges each and has no rate limit; a flooder that does not read
  its acknowledgements is paused by gRPC (it stops reading that connection). It is not
  cut: measured and documented (docs/service.md, "Measured under attack").

Every flood is bounded in frames and in time; every figure is printed (``pytest -s``).
"""

from __future__ import annotations

import statistics
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from replay_client import ReplayClient
from tests.conftest import ServerProcess, start_server
from tests.integration.raw_http2 import (
    DATA,
    END_HEADERS,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    RawConnection,
    frame,
    header_block,
)

CONFIG = """
[server]
max_call_resets_per_s = 200

[[tables]]
name = "t"
capacity = 10
"""
FRAMES = 200_000     # at most, per flood
FLOOD_S = 20.0       # at most, per flood
RSS_BOUND_MIB = 128  # what a flood may add to the server's resident memory at its peak
CANCEL = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("server"), CONFIG)
    yield proc
    proc.stop()


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def flood(port: int, kind: str) -> tuple[int, bool]:
    """Send ``kind`` frames on one connection until the server closes it or the bounds are
    reached; (frames sent, whether the server closed the connection)."""
    connection = RawConnection(port, source="127.0.0.5", timeout=2)
    assert connection.handshake()
    block = header_block([
        (":method", "POST"), (":scheme", "http"), (":path", "/replay.v1.ReplayService/Info"),
        (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
        ("te", "trailers")])
    sent, stream, closed = 0, 1, False
    deadline = time.monotonic() + FLOOD_S
    try:
        if kind == "data":  # one call whose request never ends: empty DATA frames on it
            connection.sock.sendall(frame(HEADERS, END_HEADERS, 1, block))
        while sent < FRAMES and time.monotonic() < deadline and not closed:
            burst = []
            for _ in range(100):
                if kind == "reset":
                    burst.append(frame(HEADERS, END_HEADERS, stream, block)
                                 + frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL)))
                    stream += 2
                elif kind == "settings":
                    burst.append(frame(SETTINGS, 0, 0, struct.pack(">HI", 3, 100)))
                elif kind == "ping":
                    burst.append(frame(PING, 0, 0, b"\0" * 8))
                else:
                    burst.append(frame(DATA, 0, 1, b""))
            connection.sock.sendall(b"".join(burst))
            sent += len(burst)
            closed = connection.closed_by_server()
    except (OSError, EOFError):  # reset by the server, or it stopped reading us
        closed = connection.closed_by_server()
    closed = closed or connection.closed_by_server()
    connection.close()
    return sent, closed


@pytest.mark.parametrize("kind, cut", [("reset", True), ("ping", True), ("data", True),
                                       ("settings", False)])
def test_a_frame_flood_on_one_connection_leaves_other_clients_served(server, kind, cut):
    pid = server.process.pid
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as legit:
        baseline = []
        for _ in range(30):
            start = time.monotonic()
            legit.info()
            baseline.append(time.monotonic() - start)
        idle = legit.server_info().limits["memory_in_use_bytes"]
        before = peak = rss_mib(pid)
        latencies: list[float] = []
        errors: list[Exception] = []
        result: list[tuple[int, bool]] = []
        attacker = threading.Thread(target=lambda: result.append(flood(server.port, kind)))
        attacker.start()
        while attacker.is_alive() and len(latencies) < 10_000:  # bounded by the flood's bounds
            start = time.monotonic()
            try:
                legit.info()
            except Exception as exc:  # any error a legitimate client sees fails the test
                errors.append(exc)
            latencies.append(time.monotonic() - start)
            peak = max(peak, rss_mib(pid))
        attacker.join(FLOOD_S + 30)
        sent, closed = result[0]
        latencies.sort()
        print(f"\n{kind} flood: {sent} frames sent, connection closed by the server: {closed}; "
              f"legitimate client: {len(latencies)} calls, {len(errors)} errors, p50 "
              f"{statistics.median(latencies) * 1000:.1f} ms, p99 "
              f"{latencies[int(len(latencies) * 0.99)] * 1000:.1f} ms (before: p50 "
              f"{statistics.median(baseline) * 1000:.1f} ms); server RSS {before} MiB, peak "
              f"{peak} MiB")
        assert errors == []
        assert closed == cut
        assert peak - before < RSS_BOUND_MIB
        legit.info()  # served after the flood too
        assert legit.server_info().limits["memory_in_use_bytes"] == idle
