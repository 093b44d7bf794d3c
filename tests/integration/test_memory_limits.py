"""The memory budget under attack: one real server process, its RSS sampled throughout.

Issue 10, findings 3-5: one SampleStream of huge batches drove the server
past 10 GB; large Sample calls whose answers were never read held gigabytes
for slow readers; large inserts without the token were read whole before
being refused. Now every call reserves its memory from ``memory_budget_mb``
before it holds it (its request before it is read), batches are bounded by
``max_batch_mb``, and a call without the token is refused unread.

Bounds stated here (the machine is shared, so they are generous): the
server's RSS stays within its RSS before the attack plus the budget
(256 MiB) plus 256 MiB for gRPC's own buffers and the allocator; health
checks and a 32-row sample from another client answer within 2 s each
throughout. Every attack is bounded in calls and time, on loopback.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_client import ReplayClient, errors
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import (
    ServerProcess,
    grpc_calls_only,
    module_server,
    run_threads,
    start_server,
    wait_for,
)

_chunked = grpc_calls_only()  # the chunked path's budgets, as from another host


TOKEN = "budget-test-token"
BUDGET_MIB = 256
RSS_SLACK_MIB = 320
"""What the server's RSS may grow beyond the budget: memory the budget does not count (gRPC's
own buffers, the allocator's arenas of eight learner threads): 241-263 MiB over the budget in
runs of the test below (a clean-clone CI failed at 7 MiB over a slack of 256). Unbounded, its
eight learners' 16 batches in flight (544 MB) plus that overhead (~800 MB) pass the bound."""
FAST_S = 2.0
SMALL_ROWS = 100_000

CONFIG = f"""
[server]
auth_token_env = "REPLAY_TEST_TOKEN"
memory_budget_mb = {BUDGET_MIB}
max_batch_mb = 64
max_message_mb = 128

[[tables]]
name = "small"
capacity = {SMALL_ROWS}

[[tables]]
name = "slice"
capacity = {SMALL_ROWS}
sampler = "slice"
slice_len = 32
"""

server = module_server(CONFIG, env={"REPLAY_TEST_TOKEN": TOKEN})


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ReplayClient:
    client = ReplayClient(server.address, token=TOKEN, max_retry_s=0)
    client.insert("small", {"obs": torch.randn(SMALL_ROWS, 17)})
    steps = torch.arange(SMALL_ROWS)
    client.insert("slice", {"obs": torch.randn(SMALL_ROWS, 4), "episode": steps // 100})
    return client


class Watch:
    """Samples the server's RSS, and times health checks and small samples from another client."""

    def __init__(self, server: ServerProcess) -> None:
        self._process = psutil.Process(server.process.pid)
        self.start_rss = self._process.memory_info().rss
        self.peak_rss = self.start_rss
        self.slowest_s = 0.0
        self.checks = 0
        self._stop = threading.Event()
        self._address = server.address
        self._threads = [threading.Thread(target=self._rss, daemon=True),
                         threading.Thread(target=self._probe, daemon=True)]

    @property
    def bound(self) -> int:
        return self.start_rss + (BUDGET_MIB + RSS_SLACK_MIB) * 2**20

    def _rss(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
            time.sleep(0.02)

    def _probe(self) -> None:
        other = ReplayClient(self._address, token=TOKEN, timeout=30, max_retry_s=0)
        with grpc.insecure_channel(self._address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                start = time.monotonic()
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                assert other.sample("small", 32).ids.shape == (32,)
                self.slowest_s = max(self.slowest_s, time.monotonic() - start)
                self.checks += 1
                self._stop.wait(0.1)

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def check(self) -> None:
        assert self.checks >= 3, "the probe did not run"
        mib = 2**20
        print(f"server RSS {self.start_rss / mib:.0f} MiB before, peak {self.peak_rss / mib:.0f}"
              f" MiB (budget {BUDGET_MIB} MiB); slowest probe {self.slowest_s:.2f} s")
        assert self.peak_rss <= self.bound, (
            f"server RSS peaked at {self.peak_rss / mib:.0f} MiB, over the bound of "
            f"{self.bound / mib:.0f} MiB ({self.start_rss / mib:.0f} MiB before + budget + slack)")
        assert self.slowest_s < FAST_S, f"a health check + small sample took {self.slowest_s:.2f} s"




def in_use(client: ReplayClient) -> int:
    return client.server_info().limits["memory_in_use_bytes"]


def test_a_stream_of_huge_batches_is_refused_naming_the_limit(server, client) -> None:
    with Watch(server) as watch:
        # 2**20 slices of 32 steps: about 1 GiB per batch, over max_batch_mb = 64.
        with pytest.raises(errors.LimitExceededError, match="server.max_batch_mb = 64"):
            next(iter(client.stream("slice", 2**20, shared_memory=False)))
        with pytest.raises(errors.LimitExceededError, match="server.max_batch_mb = 64"):
            client.sample("small", 900_000)  # 79 MB: within max_message_mb, over max_batch_mb
        # Eight learners at once, each batch under the limit (about 34 MB): the budget
        # admits a few groups at a time and the rest wait their turn.
        got: list[object] = []

        def learner() -> None:
            try:
                stream = client.stream("slice", 33_000, num_batches=2, prefetch=2,
                                       shared_memory=False)
                got.extend(batch.ids.shape for batch in stream)
            except BaseException as exc:  # reported below
                got.append(exc)

        run_threads(learner, 8, timeout=120)
    assert got == [(33_000, 32)] * 16, [g for g in got if isinstance(g, BaseException)]
    watch.check()
    limits = client.server_info().limits
    assert limits["memory_peak_bytes"] <= BUDGET_MIB * 2**20
    assert wait_for(lambda: in_use(client) == 0)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """Literal header fields without indexing, new names, no Huffman (RFC 7541 6.2.2)."""

    def length(n: int) -> bytes:  # a 7-bit prefix integer, H bit clear
        if n < 127:
            return bytes([n])
        out, n = bytearray([127]), n - 127
        while n >= 128:
            out.append(n % 128 + 128)
            n //= 128
        return bytes(out + bytearray([n]))

    block = bytearray()
    for name, value in headers:
        block += b"\0" + length(len(name)) + name.encode() + length(len(value)) + value.encode()
    return bytes(block)


class ReaderThatNeverReads:
    """A raw HTTP/2 client that sends its calls but grants the server no flow-control
    window (SETTINGS_INITIAL_WINDOW_SIZE = 0): not one byte of its answers' data can
    leave the server. It acknowledges SETTINGS and PINGs, as a live peer does."""

    def __init__(self, address: str, calls: int) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=30)
        request = pb.SampleRequest(table="small", batch_size=700_000).SerializeToString()
        out = bytearray(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        out += _frame(0x4, 0, 0, struct.pack(">HI", 0x4, 0))  # SETTINGS: initial window 0
        for call in range(calls):
            stream = 1 + 2 * call
            out += _frame(0x1, 0x4, stream, _hpack([  # HEADERS, END_HEADERS
                (":method", "POST"), (":scheme", "http"), (":authority", address),
                (":path", "/replay.v1.ReplayService/Sample"), ("content-type", "application/grpc"),
                ("te", "trailers"), ("authorization", f"Bearer {TOKEN}")]))
            message = b"\0" + struct.pack(">I", len(request)) + request
            out += _frame(0x0, 0x1, stream, message)  # DATA, END_STREAM
        self._sock.sendall(out)
        self._reader = threading.Thread(target=self._answer_control_frames, daemon=True)
        self._reader.start()

    def _answer_control_frames(self) -> None:
        buffer = b""
        try:
            while True:
                data = self._sock.recv(1 << 16)
                if not data:
                    return
                buffer += data
                while len(buffer) >= 9:
                    size = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + size:
                        break
                    kind, flags, payload = buffer[3], buffer[4], buffer[9:9 + size]
                    buffer = buffer[9 + size:]
                    if kind == 0x4 and not flags & 0x1:
                        self._sock.sendall(_frame(0x4, 0x1, 0, b""))  # SETTINGS ACK
                    elif kind == 0x6 and not flags & 0x1:
                        self._sock.sendall(_frame(0x6, 0x1, 0, payload))  # PING ACK
        except OSError:
            return

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread; the server sees EOF
        self._reader.join(10)
        self._sock.close()


def test_answers_held_for_readers_that_never_read_stay_within_the_budget(server, client) -> None:
    refused_before = client.server_info().limits["refused_calls"]
    with Watch(server) as watch:
        # 30 calls for 62 MB answers, over one connection that never takes any of them.
        reader = ReaderThatNeverReads(server.address, calls=30)
        try:
            # Each call reserved its answer before drawing it: the budget admits one, and
            # the others are refused (RESOURCE_EXHAUSTED, kind overloaded) with nothing drawn.
            # (refused_calls counts calls: it counted every refused try of a call that then
            # waited for room, so it passed 29 before the answer was reserved: a CI failure.)
            assert wait_for(lambda: client.server_info().limits["refused_calls"]
                            >= refused_before + 29)
            assert wait_for(lambda: in_use(client) >= 100 * 2**20)  # the unread answer
            with pytest.raises(errors.OverloadedError, match="server.memory_budget_mb"):
                client.sample("small", 500_000)  # so a large sample is refused, naming it
            time.sleep(1.0)  # the probe goes on while the answer is held
            assert in_use(client) >= 100 * 2**20  # ... which stays reserved
            # the reader's 29 and the large sample: no call counted twice, none served counted
            assert client.server_info().limits["refused_calls"] == refused_before + 30
        finally:
            reader.close()
    watch.check()
    assert client.server_info().limits["memory_peak_bytes"] <= BUDGET_MIB * 2**20
    assert wait_for(lambda: in_use(client) == 0)  # released once the reader was gone


def test_calls_without_the_token_are_refused_before_their_body_is_read(server, client) -> None:
    body = b"\0" * (60 << 20)
    with Watch(server) as watch, grpc.insecure_channel(
            server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        insert = channel.unary_unary("/replay.v1.ReplayService/Insert")
        futures = [insert.future(body, timeout=60) for _ in range(20)]  # 1.2 GB, no token
        codes = []
        for future in futures:
            with pytest.raises(grpc.RpcError) as info:
                future.result()
            codes.append(info.value.code())
    # Refused for the token, or (the bytes its refused calls keep sending are no call's) cut by
    # the control meter once over server.max_control_bytes_per_s: the 13th of 20 in one CI run.
    assert codes[0] == grpc.StatusCode.UNAUTHENTICATED
    assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE}, codes
    watch.check()
    # Reading the bodies would hold 1.2 GB. What a refused call can still cost is what
    # gRPC's HTTP/2 flow control lets its client send before the refusal: tens of KB
    # per call on a quiet host, up to about 15 MB on a loaded one (the window grows with
    # the round-trip time gRPC measures). So: well under half the bodies.
    assert watch.peak_rss <= watch.start_rss + 20 * len(body) // 3


@pytest.mark.slow
def test_the_reported_floods_at_their_full_size_stay_within_the_budget(server, client) -> None:
    """The sizes of the report: 100 unread 62 MB answers, 100 large inserts without the token."""
    with Watch(server) as watch:
        reader = ReaderThatNeverReads(server.address, calls=100)
        try:
            assert wait_for(lambda: client.server_info().limits["refused_calls"] >= 99,
                            timeout=120)
            with grpc.insecure_channel(
                    server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
                insert = channel.unary_unary("/replay.v1.ReplayService/Insert")
                futures = [insert.future(b"\0" * (60 << 20), timeout=300) for _ in range(100)]
                codes = []
                for future in futures:
                    with pytest.raises(grpc.RpcError) as info:
                        future.result()
                    codes.append(info.value.code())
                # Refused unread; a connection without the token is also closed after the
                # handshake deadline (server.handshake_timeout_s), ending what it still sends.
                assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED,
                                      grpc.StatusCode.UNAVAILABLE}, codes
                assert grpc.StatusCode.UNAUTHENTICATED in codes
        finally:
            reader.close()
    watch.check()
    assert wait_for(lambda: in_use(client) == 0)


# ---------------------------------------------------------------- issue 23, finding 10

ATARI = (84, 84, 4)


def test_an_address_space_too_small_to_serve_stops_the_start_saying_so(tmp_path) -> None:
    """Under a 2.3 GB RLIMIT_AS the server started, then died of std::bad_alloc under load."""
    limit = 2300 << 20
    with pytest.raises(RuntimeError) as info:
        start_server(tmp_path, "[[tables]]\nname = \"t\"\ncapacity = 1000\n",
                     rlimits={"AS": (limit, limit)})
    message = str(info.value)
    assert "server exited with 2" in message
    assert "replay-server: not enough memory or disk space: this process may map at most " \
           "2.2 GiB (ulimit -v, RLIMIT_AS)" in message and "memory_budget_mb" in message
    assert "bad_alloc" not in message and "Traceback" not in message


def test_under_an_address_space_limit_tables_get_only_what_it_leaves(tmp_path) -> None:
    limit = 3500 << 20
    config = """
[server]
max_message_mb = 128

[[tables]]
name = "fits"
capacity = 20_000

[[tables]]
name = "too_big"
capacity = 50_000
"""
    server = start_server(tmp_path, config, rlimits={"AS": (limit, limit)})
    try:
        client = ReplayClient(server.address, timeout=60, max_message_mb=128)
        with pytest.raises(errors.LimitExceededError, match=r"ulimit -v \(RLIMIT_AS\)"):
            client.insert("too_big", {"obs": torch.zeros(1, *ATARI, dtype=torch.uint8)})
        refused: list[BaseException] = []

        def load() -> None:
            mine = ReplayClient(server.address, timeout=60, max_message_mb=128, max_retry_s=0)
            for _ in range(8):
                try:
                    mine.insert("fits", {"obs": torch.zeros(1024, *ATARI, dtype=torch.uint8)})
                    mine.sample("fits", 2048)
                except errors.OverloadedError as exc:  # the budget, or memory: a clear refusal
                    refused.append(exc)

        run_threads(load, 4, timeout=300)
        assert client.info()["fits"].size == 20_000
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert "bad_alloc" not in server.log() and "Unexpected [MemoryError]" not in server.log()
