"""Malformed bytes on the wire, sent past the client library.

Raw requests go through a plain channel (``unary_unary`` without serializers);
pure-protobuf ones through the generated stubs. Each must be refused with
INVALID_ARGUMENT or NOT_FOUND and the trailing metadata ``replay-error-kind``,
and leave the server serving (health SERVING, a valid insert and sample work)
with its tables unchanged. A bounded hypothesis fuzz of Insert, UpdatePriorities
and Sample bodies must never get INTERNAL or UNKNOWN, nor kill the server; a
refused fuzzed request must leave every table's info (sizes, counters, rate
limiter state) as it was, and fuzzing must not grow the server's resident
memory.

One server serves the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay_client import ReplayClient
from replay_proto import messages
from replay_proto.codec import frame
from replay_proto.v1 import replay_pb2 as pb
from replay_proto.v1 import replay_pb2_grpc
from tests.conftest import ServerProcess, start_server
from tests.wire import encode_insert

SERVICE = "/replay.v1.ReplayService/"
KIND_KEY = "replay-error-kind"
PAYLOAD_TAG = bytes([(15 << 3) | 2])
CALL_TIMEOUT_S = 20

CONFIG = """
[server]
max_message_mb = 4

[[tables]]
name = "u"
capacity = 100
sampler = "uniform"
[tables.schema]
obs = "float32[3]"

[[tables]]
name = "p"
capacity = 100
sampler = "prioritized"
[tables.schema]
obs = "float32[3]"

[[tables]]
name = "open"
capacity = 100
sampler = "uniform"

[[tables]]
name = "slices"
capacity = 100
sampler = "slice"
slice_len = 2

[[tables]]
name = "limited"              # a rate limiter that always admits once filled
capacity = 100
sampler = "prioritized"
min_size_to_sample = 2
samples_per_insert = 1.0
error_buffer = 1e12
max_times_sampled = 1000000
"""


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("malformed"), CONFIG)
    client = ReplayClient(proc.address, timeout=30)
    client.insert("u", {"obs": torch.arange(12.0).reshape(4, 3)})
    client.insert("p", {"obs": torch.arange(12.0).reshape(4, 3)}, priorities=torch.ones(4))
    client.insert("limited", {"obs": torch.ones(4, 3)})
    client.close()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def channel(served: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(served.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> replay_pb2_grpc.ReplayServiceStub:
    return replay_pb2_grpc.ReplayServiceStub(channel)


# ------------------------------------------------------------------- helpers


def spec(key: str, dtype: str, shape: list[int]) -> pb.TensorSpec:
    return pb.TensorSpec(key=key, dtype=dtype, shape=shape)


def insert_bytes(table: str, specs: list[pb.TensorSpec], payload: bytes, **fields) -> bytes:
    return frame(pb.InsertRequest(table=table, columns=specs, **fields), [payload])


OBS = [spec("obs", "float32", [2, 3])]
VALID_INSERT = insert_bytes("u", OBS, b"\0" * 24)


def send_raw(channel: grpc.Channel, method: str, raw: bytes) -> grpc.RpcError | None:
    """Send ``raw`` to ``method``; the error it got, or None if it succeeded."""
    try:
        channel.unary_unary(SERVICE + method)(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc
    return None


def kind_of(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get(KIND_KEY)


def snapshot(stub: replay_pb2_grpc.ReplayServiceStub) -> pb.InfoResponse:
    """The tables' state (the process's memory and uptime, the connections open now and the
    shared memory in use left out: they move by themselves, a client of an earlier case
    closing late)."""
    response = stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT_S)
    response.ClearField("server")
    response.limits.ClearField("connections_open")
    response.limits.ClearField("shared_memory_in_use_bytes")  # a sample region, released late
    return response


def assert_still_serves(served: ServerProcess, channel: grpc.Channel,
                        stub: replay_pb2_grpc.ReplayServiceStub,
                        before: pb.InfoResponse) -> None:
    """Tables as ``before``; health SERVING; a valid insert and sample work."""
    assert snapshot(stub) == before
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with ReplayClient(served.address, timeout=CALL_TIMEOUT_S) as client:
        ids = client.insert("u", {"obs": torch.full((2, 3), 7.0)})
        assert ids.shape == (2,)
        assert client.sample("u", 8).data["obs"].shape == (8, 3)


# --------------------------------------------------------- raw malformed bytes

RAW_CASES: dict[str, tuple[str, bytes, grpc.StatusCode, str, str]] = {
    # name: (method, raw bytes, code, replay-error-kind, fragment of the details)
    "wrong-dtype": ("Insert", insert_bytes("u", [spec("obs", "float128", [2, 3])], b"\0" * 48),
                    grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "'float128'"),
    "payload-too-short": ("Insert", insert_bytes("u", OBS, b"\0" * 20),
                          grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "needs 24 bytes"),
    "payload-too-long": ("Insert", insert_bytes("u", OBS, b"\0" * 30),
                         grpc.StatusCode.INVALID_ARGUMENT, "malformed_request",
                         "payload has 30 bytes"),
    "negative-shape": ("Insert", insert_bytes("u", [spec("obs", "float32", [-2, 3])], b""),
                       grpc.StatusCode.INVALID_ARGUMENT, "malformed_request",
                       "negative dimension"),
    # Issue 23, finding 10: a row of 10,000 dimensions was INTERNAL (numpy's limit is 64).
    "ten-thousand-dims": ("Insert", insert_bytes("open", [spec("obs", "float32", [1] * 10_000)],
                                                 b"\0" * 4),
                          grpc.StatusCode.INVALID_ARGUMENT, "malformed_request",
                          "10000 dimensions, at most 64"),
    "unknown-table": ("Insert", insert_bytes("nope", OBS, b"\0" * 24),
                      grpc.StatusCode.NOT_FOUND, "unknown_table", "'nope'"),
    "schema-mismatch": ("Insert", insert_bytes("u", [spec("obs", "float64", [2, 3])], b"\0" * 48),
                        grpc.StatusCode.INVALID_ARGUMENT, "schema_mismatch", "float64[3]"),
    "garbage-insert": ("Insert", b"\xff" * 11 + b"\x01 this is not protobuf",
                       grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "varint"),
    "truncated": ("Insert", VALID_INSERT[:-7],
                  grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "truncated"),
    "two-payloads": ("Insert", VALID_INSERT + PAYLOAD_TAG + b"\x04\0\0\0\0",
                     grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "two payload fields"),
    "priorities-without-room": ("Insert", insert_bytes("p", OBS, b"\0" * 24, has_priorities=True),
                                grpc.StatusCode.INVALID_ARGUMENT, "malformed_request",
                                "2 float64"),
    "update-garbage": ("UpdatePriorities", b"\x0f\xff\xee",
                       grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "wire type"),
    "update-leftover-bytes": ("UpdatePriorities",
                              frame(pb.UpdatePrioritiesRequest(table="p", count=1), [b"\0" * 20]),
                              grpc.StatusCode.INVALID_ARGUMENT, "malformed_request",
                              "payload has 20 bytes"),
    "sample-garbage": ("Sample", b"\x12\xff\xff\xff\xff\x0f",
                       grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "SampleRequest"),
    "reset-garbage": ("Reset", b"\x0a\x05ab",
                      grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "ResetRequest"),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_malformed_raw_request_gets_a_typed_status(channel, case) -> None:
    method, raw, code, kind, fragment = RAW_CASES[case]
    error = send_raw(channel, method, raw)
    assert error is not None, "the server accepted a malformed request"
    assert (error.code(), kind_of(error)) == (code, kind), error.details()
    assert fragment in error.details(), error.details()


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_malformed_raw_request_leaves_the_server_serving_and_unchanged(
    served, channel, stub, case
) -> None:
    method, raw, *_ = RAW_CASES[case]
    before = snapshot(stub)
    send_raw(channel, method, raw)
    assert_still_serves(served, channel, stub, before)


def test_a_unary_call_that_sends_no_request_gets_invalid_argument(served, channel, stub) -> None:
    # The unary RPCs are served by stream-unary handlers (memory is reserved before the
    # request is read), so a raw client can end its side without sending the request.
    before = snapshot(stub)
    for method in ("Insert", "Sample", "UpdatePriorities"):
        with pytest.raises(grpc.RpcError) as caught:
            channel.stream_unary(SERVICE + method)(iter(()), timeout=CALL_TIMEOUT_S)
        error = caught.value
        assert (error.code(), kind_of(error)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "malformed_request"), error.details()
        assert f"{method}: the call carried no request" in error.details()
    assert_still_serves(served, channel, stub, before)


def test_zero_byte_column_with_overflowing_dims_gets_invalid_argument(channel) -> None:
    raw = insert_bytes("open", [spec("obs", "float32", [0, 2**62, 2**62])], b"")
    error = send_raw(channel, "Insert", raw)
    assert error is not None
    assert (error.code(), kind_of(error)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                              "malformed_request")


# ----------------------------------------------------- pure protobuf via stubs


def stub_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


STUB_CASES = {
    "update-count-larger-than-payload": (
        lambda s: s.UpdatePriorities(pb.UpdatePrioritiesRequest(table="p", count=5,
                                                                payload=b"\0" * 16),
                                     timeout=CALL_TIMEOUT_S),
        grpc.StatusCode.INVALID_ARGUMENT, "malformed_request", "5 int64"),
    "stream-negative-num-batches": (
        lambda s: list(s.SampleStream(iter([pb.SampleStreamRequest(
            request=pb.SampleRequest(table="u", batch_size=2, num_batches=-1), credits=2)]),
            timeout=CALL_TIMEOUT_S)),
        grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "num_batches"),
    "stream-without-credits": (
        lambda s: list(s.SampleStream(iter([pb.SampleStreamRequest(
            request=pb.SampleRequest(table="u", batch_size=2))]), timeout=CALL_TIMEOUT_S)),
        grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "credits in [1, 1024]"),
    "stream-first-message-without-request": (
        lambda s: list(s.SampleStream(iter([pb.SampleStreamRequest(credits=2)]),
                                      timeout=CALL_TIMEOUT_S)),
        grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "must carry `request`"),
    "stream-unknown-table": (
        lambda s: list(s.SampleStream(iter([pb.SampleStreamRequest(
            request=pb.SampleRequest(table="nope", batch_size=2), credits=2)]),
            timeout=CALL_TIMEOUT_S)),
        grpc.StatusCode.NOT_FOUND, "unknown_table", "'nope'"),
    "sample-unknown-table": (
        lambda s: s.Sample(pb.SampleRequest(table="nope", batch_size=2), timeout=CALL_TIMEOUT_S),
        grpc.StatusCode.NOT_FOUND, "unknown_table", "'nope'"),
    "sample-negative-batch": (
        lambda s: s.Sample(pb.SampleRequest(table="u", batch_size=-3), timeout=CALL_TIMEOUT_S),
        grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "batch_size"),
    "update-unknown-table": (
        lambda s: s.UpdatePriorities(pb.UpdatePrioritiesRequest(table="nope"),
                                     timeout=CALL_TIMEOUT_S),
        grpc.StatusCode.NOT_FOUND, "unknown_table", "'nope'"),
    "reset-unknown-table": (
        lambda s: s.Reset(pb.ResetRequest(table="nope"), timeout=CALL_TIMEOUT_S),
        grpc.StatusCode.NOT_FOUND, "unknown_table", "'nope'"),
}


@pytest.mark.parametrize("case", list(STUB_CASES))
def test_bad_protobuf_request_gets_a_typed_status(stub, case) -> None:
    call, code, kind, fragment = STUB_CASES[case]
    error = stub_error(lambda: call(stub))
    assert (error.code(), kind_of(error)) == (code, kind), error.details()
    assert fragment in error.details(), error.details()


@pytest.mark.parametrize("case", list(STUB_CASES))
def test_bad_protobuf_request_leaves_the_server_serving_and_unchanged(
    served, channel, stub, case
) -> None:
    before = snapshot(stub)
    stub_error(lambda: STUB_CASES[case][0](stub))
    assert_still_serves(served, channel, stub, before)


LATER_STREAM_MESSAGES = {
    "not-protobuf": b"\xff\xff\xff",
    "negative-credits": pb.SampleStreamRequest(credits=-1).SerializeToString(),
    "a-second-request": pb.SampleStreamRequest(
        request=pb.SampleRequest(table="u", batch_size=2), credits=1).SerializeToString(),
}


@pytest.mark.parametrize("later", list(LATER_STREAM_MESSAGES))
def test_a_malformed_later_stream_message_ends_the_stream_with_invalid_argument(
    served, channel, stub, later
) -> None:
    """A learner speaking another protocol is told so, not silently ignored."""
    first = pb.SampleStreamRequest(request=pb.SampleRequest(table="u", batch_size=2),
                                   credits=1).SerializeToString()
    call = channel.stream_stream(SERVICE + "SampleStream")  # raw bytes both ways
    responses = call(iter([first, LATER_STREAM_MESSAGES[later]]), timeout=CALL_TIMEOUT_S)
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for raw in responses:
            received.append(raw)
    assert len(received) <= 1  # at most the batch its one credit allowed
    assert (info.value.code(), kind_of(info.value)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                        "invalid_argument")
    assert "SampleStream" in info.value.details()
    assert_still_serves(served, channel, stub, snapshot(stub))


def test_generated_stub_sample_decodes_as_plain_protobuf(stub) -> None:
    response = stub.Sample(pb.SampleRequest(table="u", batch_size=3), timeout=CALL_TIMEOUT_S)
    assert response.batch_rows == 3 and response.last_chunk
    assert [c.key for c in response.columns] == ["obs"]
    assert len(response.payload) == 3 * (12 + 8 + 4 + 8)


# -------------------------------------------------------------------- fuzzing

FUZZED_METHODS = ("Insert", "UpdatePriorities", "Sample")
NEVER = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

SEEDS: tuple[tuple[str, bytes], ...] = (
    ("Insert", encode_insert("u", {"obs": torch.arange(6.0).reshape(2, 3)})),
    ("Insert", encode_insert("p", {"obs": torch.ones(2, 3)}, torch.tensor([1.0, 2.0]))),
    ("Insert", encode_insert("open", {"a": torch.arange(3),
                                               "b": torch.ones(3, 2).bool()})),
    ("Insert", encode_insert("slices", {"episode": torch.tensor([1, 1, 2]),
                                                 "done": torch.tensor([False, True, False]),
                                                 "x": torch.ones(3, 2, dtype=torch.float16)})),
    ("UpdatePriorities", messages.encode_update("p", np.array([0, 1, 2]),
                                                np.array([1.0, 0.5, 2.0]))),
    ("Sample", pb.SampleRequest(table="u", batch_size=4).SerializeToString()),
    ("Sample", pb.SampleRequest(table="p", batch_size=4).SerializeToString()),
    ("Sample", pb.SampleRequest(table="slices", batch_size=2).SerializeToString()),
    ("Insert", encode_insert("limited", {"obs": torch.ones(2, 3)})),
    ("Sample", pb.SampleRequest(table="limited", batch_size=4).SerializeToString()),
    ("UpdatePriorities", messages.encode_update("limited", np.array([0, 1]),
                                                np.array([2.0, 0.5]))),
)


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid request with 1-4 random byte edits (flip, set, insert, delete, truncate)."""
    method, raw = draw(st.sampled_from(SEEDS))
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            del data[i:]
    return method, bytes(data)


FUZZ_SETTINGS = settings(max_examples=150, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow])


def assert_never_internal(channel: grpc.Channel, method: str, raw: bytes) -> None:
    error = send_raw(channel, method, raw)
    if error is not None:
        assert error.code() not in NEVER, f"{method} {raw!r}: {error.code()} {error.details()}"


def test_fuzzed_random_bytes_never_get_internal_or_unknown(served, channel) -> None:
    @FUZZ_SETTINGS
    @given(method=st.sampled_from(FUZZED_METHODS), raw=st.binary(max_size=256))
    def check(method: str, raw: bytes) -> None:
        assert_never_internal(channel, method, raw)

    check()
    assert served.process.poll() is None, served.log()[-3000:]


def test_fuzzed_mutations_of_valid_requests_never_get_internal_or_unknown(
    served, channel
) -> None:
    @FUZZ_SETTINGS
    @given(request=mutated_requests())
    def check(request: tuple[str, bytes]) -> None:
        assert_never_internal(channel, *request)

    check()
    assert served.process.poll() is None, served.log()[-3000:]


def test_server_is_healthy_after_fuzzing(served, channel) -> None:
    # Runs after the fuzz tests in file order; on its own it still checks health.
    assert served.process.poll() is None
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


# ----------------------------------------- fuzzing: tables unchanged, memory flat

WARM_UP_CASES = 100
MEASURED_CASES = 400
RSS_SLACK_BYTES = 8 << 20  # allocator and gRPC buffer noise


def fill_every_table(address: str) -> None:
    """Give every table its schema first, so no fuzzed insert allocates storage.

    A table whose schema an earlier fuzzed (valid) insert fixed keeps it."""
    with ReplayClient(address, timeout=CALL_TIMEOUT_S) as client:
        tables = client.info()
        if not tables["open"].schema:
            client.insert("open", {"a": torch.arange(3), "b": torch.ones(3, 2).bool()})
        if not tables["slices"].schema:
            client.insert("slices", {"episode": torch.tensor([1, 1, 2]),
                                     "done": torch.tensor([False, True, False]),
                                     "x": torch.ones(3, 2, dtype=torch.float16)})


def fuzz_cases(channel: grpc.Channel, stub, count: int, refused: list[int]) -> None:
    """Send ``count`` fuzzed requests; each one refused must leave ``Info`` exactly as it was."""

    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(request=st.one_of(mutated_requests(),
                             st.tuples(st.sampled_from(FUZZED_METHODS), st.binary(max_size=256))))
    def check(request: tuple[str, bytes]) -> None:
        method, raw = request
        before = snapshot(stub)
        error = send_raw(channel, method, raw)
        if error is None:
            return  # the edit left a valid request, which did its work
        assert error.code() not in NEVER, f"{method} {raw!r}: {error.code()} {error.details()}"
        assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
        assert snapshot(stub) == before, f"{method} {raw!r} was refused but changed a table"
        refused[0] += 1

    check()


def test_fuzzed_refused_requests_change_nothing_and_server_memory_stays_flat(
    served, channel, stub
) -> None:
    fill_every_table(served.address)
    process = psutil.Process(served.process.pid)
    refused = [0]
    fuzz_cases(channel, stub, WARM_UP_CASES, refused)
    warm = process.memory_info().rss
    fuzz_cases(channel, stub, MEASURED_CASES, refused)
    after = process.memory_info().rss
    assert served.process.poll() is None, served.log()[-3000:]
    assert refused[0] > (WARM_UP_CASES + MEASURED_CASES) // 2
    assert after <= warm * 1.05 + RSS_SLACK_BYTES, (
        f"server RSS grew from {warm >> 20} MiB to {after >> 20} MiB over "
        f"{MEASURED_CASES} fuzzed requests")

