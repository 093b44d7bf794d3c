"""Calls that do not speak in time lose their slot: silent calls, silent streams, stalled uploads.

Issue 34, items 2, 6 and 7: 256 unary calls that never sent their request
held every working slot (and the memory budget reserved for their requests),
refusing inserts, samples and info for 357 s while health said SERVING; 128
streams that never sent a first message refused every new learner; one
chunked upload that stalled after its first message held 760 of 768 MiB of
the budget, refusing every other client's 4 MB insert for 83 s. Now a call's
first message must come within ``server.request_timeout_s``, and each next
message of a chunked request within as long of the previous one; a call
that misses it is ended (DEADLINE_EXCEEDED, naming the setting), its slot
and memory free again.

Each attack runs against a real server on loopback with raw HTTP/2 or raw
gRPC clients; the legitimate clients on other connections use the replay
client as users do (it retries calls the server refused as overloaded,
within its timeout) and must see no error; the server's slots and memory
in use are read back at their idle values afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, grpc_calls_only, module_server, wait_for

from tests.integration.raw_http2 import RawConnection

_chunked = grpc_calls_only()  # the chunked path's budgets, as from another host

REQUEST_TIMEOUT_S = 2.0
SERVICE = "/replay.v1.ReplayService/"
CONNECTIONS = 4
SOURCES = ("127.0.0.30", "127.0.0.31")  # two addresses, each within its share of a pool
SILENT_CALLS = 256  # max_concurrent_calls' default
SILENT_STREAMS = 128  # max_streams' default
LEGIT_TIMEOUT_S = 20.0

CONFIG = f"""
[server]
request_timeout_s = {REQUEST_TIMEOUT_S}

[[tables]]
name = "steps"
capacity = 10000
"""

server = module_server(CONFIG)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=LEGIT_TIMEOUT_S) as c:
        c.insert("steps", {"obs": torch.randn(100, 4)})
        yield c


def limits(client: ReplayClient) -> dict[str, int]:
    return client.server_info().limits


def silent(server: ServerProcess, method: str, count: int) -> list[tuple[RawConnection, set]]:
    """``count`` calls of ``method`` over :data:`CONNECTIONS` raw connections from the two
    :data:`SOURCES` (one address may hold only 3/4 of a pool: ``max_host_share``), each
    opened (HEADERS, declaring a 100-byte request so the budget admits them all) and never
    sent a message; the connections with their streams."""
    opened = []
    declared = (("replay-request-bytes", "100"),)
    for i in range(CONNECTIONS):
        raw = RawConnection(server.port, source=SOURCES[i % len(SOURCES)])
        assert raw.handshake()
        streams = {raw.open_call(SERVICE + method, declared)
                   for _ in range(count // CONNECTIONS)}
        opened.append((raw, streams))
    return opened


def refused_as_overloaded(probe: ReplayClient) -> bool:
    try:
        probe.server_info()
    except errors.OverloadedError:
        return True
    return False


def stream_refused(server: ServerProcess) -> bool:
    """Whether a SampleStream opened now is refused as overloaded (the stream slots full)."""
    with grpc.insecure_channel(server.address) as channel:
        first = pb.SampleStreamRequest(request=pb.SampleRequest(
            table="steps", batch_size=1, num_batches=1), credits=1).SerializeToString()
        try:
            for _ in channel.stream_stream(SERVICE + "SampleStream")(iter([first]), timeout=10):
                pass
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return False


def assert_all_ended(opened: list[tuple[RawConnection, set]]) -> None:
    """The server ended every silent call (its trailers or a reset), within a deadline."""
    for raw, streams in opened:
        ended: set[int] = set()
        deadline = time.monotonic() + 30
        while not streams <= ended and time.monotonic() < deadline:
            ended |= raw.ended_streams(1.0)
        assert streams <= ended, f"{len(streams - ended)} silent calls still open"
        raw.close()


def test_unary_calls_that_never_send_their_request_lose_their_slot(
        server: ServerProcess, client: ReplayClient) -> None:
    idle = limits(client)
    opened = silent(server, "Insert", SILENT_CALLS)
    # Every working slot is taken: a call that does not retry is refused as overloaded ...
    with ReplayClient(server.address, timeout=LEGIT_TIMEOUT_S, max_retry_s=0) as probe:
        assert wait_for(lambda: refused_as_overloaded(probe), timeout=LEGIT_TIMEOUT_S)
    start = time.monotonic()
    # ... and the legitimate client, which retries such calls, is answered.
    client.insert("steps", {"obs": torch.randn(10, 4)})
    inserted_s = time.monotonic() - start
    assert client.sample("steps", 32).ids.shape == (32,)
    assert client.info()["steps"].size == 110
    assert_all_ended(opened)
    print(f"{SILENT_CALLS} silent unary calls: a legitimate insert answered after "
          f"{inserted_s:.2f} s (request_timeout_s = {REQUEST_TIMEOUT_S:g})")
    after = limits(client)
    assert after["calls_in_flight"] == idle["calls_in_flight"]
    assert wait_for(lambda: limits(client)["memory_in_use_bytes"] == idle["memory_in_use_bytes"])


def test_streams_that_never_send_a_first_message_lose_their_slot(
        server: ServerProcess, client: ReplayClient) -> None:
    idle = limits(client)
    opened = silent(server, "SampleStream", SILENT_STREAMS)
    # Every stream slot is taken: a stream opened now is refused as overloaded ...
    assert wait_for(lambda: stream_refused(server), timeout=LEGIT_TIMEOUT_S)
    # ... and a learner's stream, which opens again when refused so, gets its batches.
    start = time.monotonic()
    batches = [batch.ids.shape for batch in client.stream("steps", batch_size=8, num_batches=3)]
    served_s = time.monotonic() - start
    assert batches == [(8,)] * 3
    assert_all_ended(opened)  # within request_timeout_s, not when the client gives up
    print(f"{SILENT_STREAMS} silent streams: a learner's first batches after {served_s:.2f} s "
          f"(request_timeout_s = {REQUEST_TIMEOUT_S:g})")
    assert wait_for(lambda: limits(client)["streams_open"] == idle["streams_open"])
    after = limits(client)
    assert (after["calls_waiting"], after["memory_in_use_bytes"]) == (
        idle["calls_waiting"], idle["memory_in_use_bytes"])


def test_a_silent_call_is_told_which_setting_ended_it(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        release = threading.Event()

        def nothing() -> Iterator[bytes]:
            release.wait(30)
            yield from ()

        with pytest.raises(grpc.RpcError) as caught:
            channel.stream_stream(SERVICE + "SampleStream")(nothing(), timeout=30).next()
        release.set()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "server.request_timeout_s = 2 s" in caught.value.details()


STALL_TIMEOUT_S = 5.0  # the default: room for the probe to see the reservation held

STALL_CONFIG = f"""
[server]
request_timeout_s = {STALL_TIMEOUT_S}
memory_budget_mb = 256
max_batch_mb = 64

[[tables]]
name = "frames"
capacity = 1000

[[tables]]
name = "steps"
capacity = 10000
"""
STALLED_BYTES = 186 << 20  # with its 4 MiB message: 190 of the 192 MiB large calls may hold


def test_a_stalled_chunked_upload_loses_its_reservation_at_the_progress_deadline(
        server_factory) -> None:
    stall_server = server_factory(STALL_CONFIG)
    spec = pb.TensorSpec(key="pixels", dtype="uint8", shape=[186, 1 << 20])
    stalled = threading.Event()
    release = threading.Event()
    outcome: list[grpc.RpcError] = []

    def first_then_nothing() -> Iterator[bytes]:
        yield pb.InsertRequest(table="frames", columns=[spec],
                               payload_bytes=STALLED_BYTES).SerializeToString()
        stalled.set()
        release.wait(60)  # the upload stalls after announcing 186 MiB

    def staller() -> None:
        with grpc.insecure_channel(stall_server.address) as channel:
            try:
                channel.stream_unary(SERVICE + "InsertChunks")(first_then_nothing(), timeout=60)
            except grpc.RpcError as exc:
                outcome.append(exc)

    with ReplayClient(stall_server.address, timeout=LEGIT_TIMEOUT_S) as legit:
        idle = legit.server_info().limits["memory_in_use_bytes"]
        thread = threading.Thread(target=staller)
        thread.start()
        assert stalled.wait(30)
        assert wait_for(lambda: legit.server_info().limits["memory_in_use_bytes"]
                        >= idle + STALLED_BYTES)  # the staller holds the large calls' share
        start = time.monotonic()
        legit.insert("steps", {"obs": torch.randn(1000, 1000)})  # 4 MB: waits, then fits
        inserted_s = time.monotonic() - start
        assert legit.info()["steps"].size == 1000
        thread.join(30)
        release.set()
        print(f"a chunked upload stalled holding 190 of 192 MiB: a 4 MB insert answered after "
              f"{inserted_s:.2f} s (request_timeout_s = {STALL_TIMEOUT_S:g})")
        assert not thread.is_alive()
        assert [e.code() for e in outcome] == [grpc.StatusCode.DEADLINE_EXCEEDED]
        assert "chunked request did not arrive within server.request_timeout_s = 5 s" in (
            outcome[0].details())
        assert legit.info()["frames"].size == 0  # nothing of the stalled upload is stored
        assert wait_for(lambda: legit.server_info().limits["memory_in_use_bytes"] == idle)


def test_a_chunked_upload_that_trickles_loses_its_reservation_at_its_pace_deadline(
        server_factory) -> None:
    """A byte every 2.5 s keeps each message within the deadline of the previous one, but
    not the pace of one message per request_timeout_s: the trickler is ended too."""
    stall_server = server_factory(STALL_CONFIG)
    spec = pb.TensorSpec(key="pixels", dtype="uint8", shape=[186, 1 << 20])
    started = threading.Event()
    stop = threading.Event()
    outcome: list[grpc.RpcError] = []

    def trickle() -> Iterator[bytes]:
        yield pb.InsertRequest(table="frames", columns=[spec],
                               payload_bytes=STALLED_BYTES).SerializeToString()
        started.set()
        for sent in range(120):  # bounded: two minutes at most
            if stop.wait(STALL_TIMEOUT_S / 2):
                return
            yield pb.InsertRequest(payload_offset=sent, payload=b"\0").SerializeToString()

    def trickler() -> None:
        with grpc.insecure_channel(stall_server.address) as channel:
            try:
                channel.stream_unary(SERVICE + "InsertChunks")(trickle(), timeout=150)
            except grpc.RpcError as exc:
                outcome.append(exc)

    thread = threading.Thread(target=trickler)
    try:
        with ReplayClient(stall_server.address, timeout=LEGIT_TIMEOUT_S) as legit:
            idle = legit.server_info().limits["memory_in_use_bytes"]
            thread.start()
            assert started.wait(30)
            assert wait_for(lambda: legit.server_info().limits["memory_in_use_bytes"]
                            >= idle + STALLED_BYTES)
            start = time.monotonic()
            legit.insert("steps", {"obs": torch.randn(1000, 1000)})  # 4 MB: waits, then fits
            inserted_s = time.monotonic() - start
            thread.join(30)
            print(f"a chunked upload trickling a byte every {STALL_TIMEOUT_S / 2:g} s: a 4 MB "
                  f"insert answered after {inserted_s:.2f} s (request_timeout_s = "
                  f"{STALL_TIMEOUT_S:g})")
            assert not thread.is_alive()
            assert [e.code() for e in outcome] == [grpc.StatusCode.DEADLINE_EXCEEDED]
            assert "per server.request_timeout_s = 5 s on average" in outcome[0].details()
            assert legit.info()["frames"].size == 0
            assert wait_for(lambda: legit.server_info().limits["memory_in_use_bytes"] == idle)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(30)
