"""Memory bounded by the transport, not by the client's word: lying clients against a real server.

Issue 23, finding 6: 40 clients declaring 100-byte requests and sending
60 MiB inserts drove the server past 5.5 GB against ``memory_budget_mb =
256``: gRPC reads a whole message (up to ``max_message_mb``, then 64) before
any handler runs, so a declared size bounds nothing. Now every message is
at most ``max_message_mb`` (4 MiB), large requests travel in chunks reserved
whole from the budget before they are read, and a stream's flow-control
window stays 64 KiB, so the server holds at most

    budget + (max_concurrent_calls + max_streams) x (2 x max_message + 64 KiB)
           + max_waiting_calls x 96 KiB

(a message is held twice for a moment: in gRPC's buffer and in the copy it
hands the handler; a waiting unary call has read its request, in the budget,
and holds its window and its state)
(docs/service.md, "Limits"). Each attack here is made by raw gRPC clients
that declare small sizes (``replay-request-bytes``) and send large messages,
or announce small chunked requests and send more, or push chunks the server
is not reading yet, on as many streams as they like; the server's RSS is
sampled throughout and must stay within its RSS before the attack plus
that bound plus :data:`SLACK_MIB` (allocator and gRPC's own buffers). Every
attack is refused and stores nothing; health answers throughout. Bounded
sizes here; the sizes of the report run in ``make soak``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replay_client import ReplayClient
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, module_server, wait_for

BUDGET_MIB = 128
CALLS = 32
WAITING = 8
STREAMS = WAITING  # max_streams (128 by default) is capped by the waiting pool
WAITER_KIB = 96
MESSAGE_MIB = 4
WINDOW_KIB = 64
SLACK_MIB = 96
BOUND_MIB = (BUDGET_MIB + (CALLS + STREAMS) * (2 * MESSAGE_MIB + WINDOW_KIB / 1024)
             + WAITING * WAITER_KIB / 1024)

CONFIG = f"""
[server]
memory_budget_mb = {BUDGET_MIB}
max_batch_mb = 48
max_concurrent_calls = {CALLS}
max_waiting_calls = {WAITING}
max_host_share = 1.0  # every lying client is on 127.0.0.1: the whole bound

[[tables]]
name = "frames"
capacity = 1000
"""

server = module_server(CONFIG)

CHUNK = MESSAGE_MIB * 2**20 - 100_000  # a message just under the limit
FRAMES = pb.TensorSpec(key="pixels", dtype="uint8", shape=[1000, 3000])


class RssWatch:
    """Samples a server's RSS (and its health) while an attack runs."""

    def __init__(self, server: ServerProcess) -> None:
        self._process = psutil.Process(server.process.pid)
        self._address = server.address
        self.start_rss = self._process.memory_info().rss
        self.peak_rss = self.start_rss
        self.health_checks = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._rss, daemon=True),
                         threading.Thread(target=self._health, daemon=True)]

    def _rss(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
            time.sleep(0.005)

    def _health(self) -> None:
        with grpc.insecure_channel(self._address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                self.health_checks += 1
                self._stop.wait(0.05)

    def __enter__(self) -> RssWatch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # the last refusals' buffers are freed
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    @property
    def grew_mib(self) -> float:
        return (self.peak_rss - self.start_rss) / 2**20

    def check(self) -> None:
        assert self.health_checks >= 2, "the health probe did not run"
        assert self.grew_mib <= BOUND_MIB + SLACK_MIB, (
            f"server RSS grew {self.grew_mib:.0f} MiB, over the bound of {BOUND_MIB:.0f} MiB "
            f"(budget + calls x (2 x message + window)) + {SLACK_MIB} MiB slack")


# -------------------------------------------------------------- the attacks

def _declared(nbytes: int) -> tuple[tuple[str, str], ...]:
    return (("replay-request-bytes", str(nbytes)),)


def unary_lie(size: int) -> Callable[[grpc.Channel], None]:
    """An Insert of ``size`` bytes declared as 100 bytes (the report's attack)."""
    body = b"\0" * size

    def attack(channel: grpc.Channel) -> None:
        channel.unary_unary("/replay.v1.ReplayService/Insert")(
            body, timeout=60, metadata=_declared(100))

    return attack


def chunked_lie(kind: str) -> Callable[[grpc.Channel], None]:
    """InsertChunks calls that lie: more payload than announced, messages over what the
    call declared, or chunks pushed while the server waits for room in its budget."""
    def chunk(number: int) -> bytes:  # the number-th later message, in its place
        return pb.InsertRequest(payload_offset=number * CHUNK,
                                payload=b"\0" * CHUNK).SerializeToString()

    def messages() -> Iterator[bytes]:
        if kind == "push":  # a request the budget cannot hold now: chunks pushed meanwhile
            spec = pb.TensorSpec(key="pixels", dtype="uint8", shape=[60, 1_000_000])
            yield pb.InsertRequest(table="frames", columns=[spec],
                                   payload_bytes=60_000_000).SerializeToString()
            for number in range(15):
                yield chunk(number)
            return
        yield pb.InsertRequest(table="frames", columns=[FRAMES],
                               payload_bytes=3_000_000).SerializeToString()
        for number in range(12):  # 48 MB against the 3 MB announced
            yield chunk(number) if kind == "overflow" else b"\0" * CHUNK

    def attack(channel: grpc.Channel) -> None:
        declared = 100 if kind == "undeclared" else CHUNK + 1024
        channel.stream_unary("/replay.v1.ReplayService/InsertChunks")(
            messages(), timeout=60, metadata=_declared(declared))

    return attack


def stream_lie(channel: grpc.Channel) -> None:
    """A SampleStream (a waiting call) whose first message is just under the message limit,
    declared as 100 bytes."""
    call = channel.stream_stream("/replay.v1.ReplayService/SampleStream")(
        iter([b"\0" * CHUNK]), timeout=60, metadata=_declared(100))
    for _ in call:
        pass


def run_attack(server: ServerProcess, attack: Callable[[grpc.Channel], None],
               clients: int) -> dict[grpc.StatusCode, int]:
    """``clients`` threads, each on its own connection; the status codes they got."""
    codes: dict[grpc.StatusCode, int] = {}
    lock = threading.Lock()

    def one() -> None:
        with grpc.insecure_channel(server.address, options=[
                ("grpc.max_send_message_length", 1 << 30)]) as channel:
            try:
                attack(channel)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
        with lock:
            codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    return codes


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as c:
        yield c


def assert_nothing_stored(client: ReplayClient) -> None:
    info = client.server_info()
    assert info.tables["frames"].counters["inserted"] == 0
    assert wait_for(lambda: client.server_info().limits["memory_in_use_bytes"] == 0)


CUT = grpc.StatusCode.UNAVAILABLE
"""A liar's connection cut by the control meter: what it sends past what its calls declared
and the server read is bytes no call accounts for (``server.max_control_bytes_per_s``)."""

ATTACKS = {
    # name: (attack, clients, the codes every call may end with)
    "unary inserts of 24 MiB declared as 100 bytes": (
        unary_lie(24 << 20), 24, {grpc.StatusCode.RESOURCE_EXHAUSTED, CUT}),
    "unary inserts just under the message limit declared as 100 bytes": (
        unary_lie(CHUNK), 48, {grpc.StatusCode.INVALID_ARGUMENT,
                               grpc.StatusCode.RESOURCE_EXHAUSTED, CUT}),
    "chunked inserts sending more than they announce": (
        chunked_lie("overflow"), 48, {grpc.StatusCode.INVALID_ARGUMENT,
                                      grpc.StatusCode.RESOURCE_EXHAUSTED, CUT}),
    "chunked inserts whose messages exceed what they declared": (
        chunked_lie("undeclared"), 48, {grpc.StatusCode.INVALID_ARGUMENT,
                                        grpc.StatusCode.RESOURCE_EXHAUSTED, CUT}),
    "sample streams whose first message is over what they declared": (
        stream_lie, 48, {grpc.StatusCode.INVALID_ARGUMENT,
                         grpc.StatusCode.RESOURCE_EXHAUSTED, CUT}),
    "chunked inserts pushing chunks while the budget makes them wait": (
        chunked_lie("push"), 48, {grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, CUT}),
}


def test_the_default_message_limit_is_a_few_mib(client) -> None:
    assert client.server_info().limits["max_message_bytes"] == MESSAGE_MIB * 2**20


def test_the_server_states_the_bound_this_file_holds(client) -> None:
    limits = client.server_info().limits
    assert limits["max_streams"] == STREAMS
    assert limits["transport_bound_bytes"] == BOUND_MIB * 2**20


@pytest.mark.parametrize("name", list(ATTACKS))
def test_lying_clients_cannot_push_the_server_past_the_transport_bound(
        server, client, name) -> None:
    attack, clients, allowed = ATTACKS[name]
    with RssWatch(server) as watch:
        codes = run_attack(server, attack, clients)
    watch.check()
    assert set(codes) <= allowed, codes
    assert_nothing_stored(client)
    print(f"{name}: {clients} clients, server RSS +{watch.grew_mib:.0f} MiB (bound "
          f"{BOUND_MIB:.0f} MiB = budget {BUDGET_MIB} + {CALLS + STREAMS} calls and streams x "
          f"(2 x {MESSAGE_MIB} MiB + window) + {WAITING} waiters x {WAITER_KIB} KiB)")


@pytest.mark.slow
def test_the_reported_attack_at_its_full_size_stays_within_the_bound(server, client) -> None:
    """The report's figures: 40 clients sending 60 MiB inserts declared as 100 bytes, then
    200 chunked clients pushing while the budget makes them wait."""
    for attack, clients in ((unary_lie(60 << 20), 40), (chunked_lie("push"), 200),
                            (chunked_lie("overflow"), 200)):
        with RssWatch(server) as watch:
            run_attack(server, attack, clients)
        watch.check()
        print(f"{clients} clients: server RSS +{watch.grew_mib:.0f} MiB (bound {BOUND_MIB:.0f})")
    assert_nothing_stored(client)
