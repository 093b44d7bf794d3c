"""Idle connections cannot lock everyone out: ~1,000 idle sockets against a real server;
calls over ``max_concurrent_calls`` (or one address's share of them) are refused before they
are read.

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
from tests.conftest import ServerProcess, grpc_calls_only, start_server, stays, wait_for

from tests.integration.raw_http2 import RawConnection

_chunked = grpc_calls_only()  # the chunked path's budgets, as from another host

IDLE_S = 2
CALLS = 20
SHARE = 15  # one address's share of them: server.max_host_share = 0.75
ANSWER_S = 10  # generous: every answer is drawn well within it on a loaded machine
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


def _dropped_answers(server: ServerProcess, source: str) -> int:
    """Answers the server says it dropped for the client at ``source`` (its own log line,
    naming the limit that dropped them)."""
    return len(re.findall(
        rf"dropped an answer of \d+ bytes its client at ipv4:{re.escape(source)}:\d+ did not "
        rf"take within server\.response_timeout_s = {ANSWER_S} s", server.log()))


def _refused_for_share(server: ServerProcess, source: str) -> bool:
    """Whether the server refused a call from ``source`` for its address's share (its own
    log line, naming what the address holds, the pool and the setting)."""
    return re.search(
        rf"refused a call from ipv4:{re.escape(source)}:\d+: RESOURCE_EXHAUSTED \(overloaded\): "
        rf"\w+: ipv4:{re.escape(source)} holds {SHARE} of server\.max_concurrent_calls = "
        rf"{CALLS} working calls already \(server\.max_host_share = 0\.75: one address may "
        rf"hold {SHARE}\)", server.log()) is not None


@pytest.mark.parametrize(("method", "batch", "source", "second"),
                         [("Sample", 48, "127.0.0.20", "127.0.0.22"),
                          ("SampleChunks", 100, "127.0.0.21", "127.0.0.23")])
def test_calls_over_max_concurrent_calls_are_refused_and_unread_answers_are_dropped(
        server, method, batch, source, second) -> None:
    """Calls whose answers a client never reads hold working slots and memory. One address
    holds at most its share of them (server.max_host_share = 0.75: 15 of the 20): past it
    its calls are refused naming the setting, and a client elsewhere is served meanwhile
    (issue 34: one such reader once refused every other host). Two readers from two
    addresses fill the pool: then the next call is refused before it is read, naming
    max_concurrent_calls. Issue 23, finding 10: such answers were held for good (720 MiB,
    samples refused); now one not taken within response_timeout_s is dropped, freeing its
    slot and memory; so is a chunked answer (SampleChunks: 6.25 MiB in messages under the
    4 MiB limit).

    Event-based: the answers are held (the next call refused) until the server itself says
    it dropped them for response_timeout_s; no clock is read. (It read one, and with
    response_timeout_s = 3 s a loaded machine could drop the first answers before the last
    were drawn, or before the refusal was seen.)"""
    client = ReplayClient(server.address, timeout=10, max_retry_s=0)
    client.insert("big", {"x": torch.zeros(100, 16384)})  # rows of 64 KiB
    before = client.server_info().limits["memory_in_use_bytes"]
    reader = RawConnection(server.port, source=source)  # its own address: its own log lines
    assert reader.handshake()
    path = f"/replay.v1.ReplayService/{method}"
    request = pb.SampleRequest(table="big", batch_size=batch).SerializeToString()
    for _ in range(CALLS):  # answers HTTP/2 flow control holds: the client reads nothing
        reader.call(path, request)
    other = RawConnection(server.port, source=second)
    assert other.handshake()

    def refused() -> bool:
        try:
            client.info()
        except errors.OverloadedError as exc:
            assert "server.max_concurrent_calls = 20 calls already" in str(exc)
            return True
        return False

    def held() -> bool:
        """All 20 slots are held by the two readers' unread answers (the client is
        refused), or the second reader makes one more call: a slot is freed by a callback
        after its answer went out, so the client's last call could still be counted when
        the second reader's last call came (refused, and 19 held slots never refuse the
        client)."""
        if refused():
            return True
        other.call(path, request)
        return False

    def why_not() -> str:  # what the server and the connection looked like instead
        return (f"calls in flight and waiting: {client.server_info().limits}; the raw "
                f"connection closed by the server: {reader.closed_by_server()}; server log:\n"
                f"{server.log()[-4000:]}")

    try:
        # The first reader holds its share, no more, and the client is served beside it.
        assert wait_for(lambda: _refused_for_share(server, source), timeout=60), why_not()
        # its 15 and this call (once the client's last call has left the accounting)
        assert wait_for(lambda: client.server_info().limits["calls_in_flight"] == SHARE + 1,
                        timeout=30), why_not()
        assert client.sample("big", 4).data["x"].shape == (4, 16384)
        for _ in range(CALLS - SHARE):  # the second reader takes the rest of the pool
            other.call(path, request)
        assert wait_for(held, timeout=60), why_not()  # all 20 held at once
        assert _serving(server.address)  # health checks are not replay calls: never refused
        # The server drops the unread answers itself, saying so, and serves again.
        assert wait_for(lambda: _dropped_answers(server, source) >= 1,
                        timeout=ANSWER_S + 120), server.log()[-3000:]
        assert wait_for(lambda: not refused(), timeout=ANSWER_S + 120)
        assert wait_for(lambda: client.server_info().limits["calls_in_flight"] == 1)  # itself
        limits = client.server_info().limits
        assert limits["memory_in_use_bytes"] <= before + (1 << 20)  # the answers' memory
        assert limits["calls_waiting"] == 0
        assert client.sample("big", batch).data["x"].shape == (batch, 16384)
    finally:
        reader.close()
        other.close()


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

HANDSHAKE_S = 1.0
PER_HOST = 8
MAX_CONNECTIONS = 200
GUARDED = f"""
[server]
auth_token_env = "REPLAY_TEST_TOKEN"
handshake_timeout_s = {HANDSHAKE_S}
max_idle_connections_per_host = {PER_HOST}
max_connections = {MAX_CONNECTIONS}
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
