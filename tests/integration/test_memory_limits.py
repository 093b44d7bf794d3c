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

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, module_server, wait_for

TOKEN = "budget-test-token"
BUDGET_MIB = 256
RSS_SLACK_MIB = 256
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

        threads = [threading.Thread(target=learner) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert not any(t.is_alive() for t in threads)
    assert got == [(33_000, 32)] * 16, [g for g in got if isinstance(g, BaseException)]
    watch.check()
    limits = client.server_info().limits
    assert limits["memory_peak_bytes"] <= BUDGET_MIB * 2**20
    assert wait_for(lambda: in_use(client) == 0)


ATTACKER = """
import os, signal, sys, grpc
from replay_proto.v1 import replay_pb2 as pb
address, calls, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
sample = channel.unary_unary("/replay.v1.ReplayService/Sample")
request = pb.SampleRequest(table="small", batch_size=700_000).SerializeToString()
futures = [sample.future(request, timeout=120, metadata=(("authorization", f"Bearer {token}"),))
           for _ in range(calls)]
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a reader that never reads its answers
"""


@contextmanager
def stopped_reader(server: ServerProcess, calls: int) -> Iterator[subprocess.Popen]:
    """A client process that sends ``calls`` Sample calls of 700,000 rows (62 MB answers each),
    then stops (SIGSTOP) without reading a byte of them; killed on exit."""
    process = subprocess.Popen([sys.executable, "-c", ATTACKER, server.address, str(calls), TOKEN],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "sent"
        yield process
    finally:
        process.kill()
        process.wait(30)


def test_answers_held_for_readers_that_never_read_stay_within_the_budget(server, client) -> None:
    with Watch(server) as watch, stopped_reader(server, calls=30):
        # The unread answers hold the budget: a large sample is refused now, naming it.
        assert wait_for(lambda: in_use(client) >= 100 * 2**20)
        with pytest.raises(errors.OverloadedError, match="server.memory_budget_mb"):
            client.sample("small", 500_000)
        time.sleep(1.0)  # let the probe run while the answers are held
    watch.check()
    limits = client.server_info().limits
    assert limits["refused_calls"] >= 25 and limits["memory_peak_bytes"] <= BUDGET_MIB * 2**20
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
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 20
    watch.check()
    assert watch.peak_rss <= watch.start_rss + 128 * 2**20  # no body was read
