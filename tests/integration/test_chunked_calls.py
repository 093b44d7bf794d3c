"""Large inserts, samples, publishes and fetches travel in chunks under a 1 MiB message limit.

One real server process (``max_message_mb = 1``); the real client with the
same limit, and raw gRPC clients for the old one-message calls and for
malformed chunk streams. Every row and tensor is compared exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto import messages, variable_codec
from replay_proto.chunks import frame_chunks
from replay_proto.codec import frame, split_payload
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, grpc_calls_only, module_server, wait_for

from tests.wire import encode_insert

_chunked = grpc_calls_only()  # the chunked path's budgets, as from another host

ROW = (64, 64, 4)  # uint8: 16 KiB per row
WIDE_ROW = (1024, 1024, 2)  # uint8: 2 MiB per row, over the message limit

CONFIG = """
[server]
max_message_mb = 1
memory_budget_mb = 64
max_batch_mb = 24

[[tables]]
name = "frames"
capacity = 1000

[[tables]]
name = "wide"
capacity = 4

[[tables]]
name = "written"
capacity = 1000
"""

server = module_server(CONFIG)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=60, max_message_mb=1, max_retry_s=2) as c:
        yield c


@pytest.fixture
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address, options=[
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)]) as ch:
        yield ch


def frames(first: int, n: int) -> dict[str, torch.Tensor]:
    """Rows whose every byte and ``step`` say which row they are."""
    steps = torch.arange(first, first + n)
    pixels = (steps % 251).to(torch.uint8)[:, None, None, None].expand(n, *ROW).contiguous()
    return {"pixels": pixels, "step": steps}


def assert_exact(batch) -> None:
    """Every sampled row holds the pixels its ``step`` says."""
    expected = (batch.data["step"] % 251).to(torch.uint8)[:, None, None, None]
    assert torch.equal(batch.data["pixels"], expected.expand(-1, *ROW))


def rpc_error(fn) -> errors.ReplayError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return errors.from_rpc_error(info.value, "server")


def test_an_insert_over_the_message_limit_is_stored_whole_and_exact(client) -> None:
    data = frames(0, 300)  # 4.7 MiB: five chunks
    before = client.info()["frames"].size
    ids = client.insert("frames", data)
    assert ids.shape == (300,) and torch.equal(ids - ids[0], torch.arange(300))
    assert client.info()["frames"].size == before + 300
    batch = client.sample("frames", 40)
    assert_exact(batch)


def test_a_writers_batches_over_the_message_limit_are_stored_in_order_and_exact(client) -> None:
    # batch_rows=100: 1.6 MiB a batch, sent as two chunks of the 1 MiB message limit
    data = frames(0, 250)
    with client.writer("written", batch_rows=100, episode_key=None) as writer:
        for row in range(250):
            writer.append({key: value[row] for key, value in data.items()})
    assert writer.rows_written == 250
    stored = client.read("written", positions=list(range(250))).columns
    assert torch.equal(stored["step"], data["step"])
    assert torch.equal(stored["pixels"], data["pixels"])


def test_a_sample_over_the_message_limit_arrives_whole_and_exact(client) -> None:
    if client.info()["frames"].size < 300:
        client.insert("frames", frames(0, 300))
    batch = client.sample("frames", 200)  # 3.1 MiB: SampleChunks
    assert batch.ids.shape == (200,)
    assert_exact(batch)
    again = client.sample("frames", 250)  # remembered: straight to chunks
    assert_exact(again)


def test_a_variable_over_the_message_limit_is_published_and_fetched_exact(client) -> None:
    state = {"w": torch.randn(700, 1000), "b": torch.arange(5, dtype=torch.int32)}  # 2.7 MiB
    version = client.publish("policy", state)
    fetched = client.fetch("policy")
    assert fetched.version == version
    for key, value in state.items():
        assert torch.equal(fetched[key], value)
    small = {"x": torch.ones(3)}
    assert client.publish("small", small) == 1
    assert torch.equal(client.fetch("small")["x"], small["x"])


def test_old_one_message_calls_under_the_limit_are_served(channel, client) -> None:
    insert = channel.unary_unary("/replay.v1.ReplayService/Insert")
    raw = encode_insert("frames", frames(1000, 10))
    ids = messages.decode_insert_response(insert(raw, timeout=30))
    assert ids.shape == (10,)
    sample = channel.unary_unary("/replay.v1.ReplayService/Sample")
    answer = sample(pb.SampleRequest(table="frames", batch_size=8).SerializeToString(),
                    timeout=30)
    assert pb.SampleResponse.FromString(answer).batch_rows == 8


def test_a_unary_sample_over_the_limit_is_refused_naming_the_chunked_call(channel) -> None:
    sample = channel.unary_unary("/replay.v1.ReplayService/Sample")
    request = pb.SampleRequest(table="frames", batch_size=200).SerializeToString()
    error = rpc_error(lambda: sample(request, timeout=30))
    assert isinstance(error, errors.MessageTooLargeError)
    assert "SampleChunks" in str(error)


def test_a_unary_insert_over_the_limit_is_refused_by_the_transport(channel, client) -> None:
    before = client.info()["frames"].counters["inserted"]
    insert = channel.unary_unary("/replay.v1.ReplayService/Insert")
    error = rpc_error(lambda: insert(encode_insert("frames", frames(0, 80)), timeout=30))
    assert isinstance(error, errors.MessageTooLargeError)
    assert client.info()["frames"].counters["inserted"] == before


def test_a_row_over_the_message_limit_is_stored_but_not_sampled_naming_the_limit(client) -> None:
    row = {"image": torch.full((1, *WIDE_ROW), 7, dtype=torch.uint8)}
    assert client.insert("wide", row).shape == (1,)
    with pytest.raises(errors.LimitExceededError, match="server.max_message_mb"):
        client.sample("wide", 1)


def chunked_call(channel: grpc.Channel, parts: list[bytes], declared: int | None = None):
    call = channel.stream_unary("/replay.v1.ReplayService/InsertChunks")
    size = declared if declared is not None else max(map(len, parts))
    return call(iter(parts), timeout=30, metadata=(("replay-request-bytes", str(size)),))


def good_parts(n: int = 200) -> list[bytes]:
    header, buffers = messages.insert_parts("frames", frames(0, n))
    return frame_chunks(header, buffers, 900_000)


def later(offset: int, payload: bytes, **fields) -> bytes:
    """A later message of a transfer, said to start at ``offset`` of the payload."""
    return frame(pb.InsertRequest(payload_offset=offset, **fields), [payload])


def payload_of(part: bytes) -> bytes:
    return bytes(split_payload(part, pb.InsertRequest)[1])


def damaged(parts: list[bytes], damage: str) -> tuple[list[bytes], str]:
    """``parts`` damaged as ``damage`` says, and what the refusal must say."""
    start = pb.InsertRequest.FromString(parts[2]).payload_offset
    total = pb.InsertRequest.FromString(parts[0]).payload_bytes
    if damage == "header in a later message":
        parts[2] = later(start, b"\0" * 10, table="frames")
        return parts, "message 3 of a chunked transfer may carry only payload"
    if damage == "more than announced":
        return [*parts, later(total, b"\0" * 10)], "more payload than"
    if damage == "ends early":
        return parts[:-1], "ended after"
    if damage == "reordered":
        parts[1], parts[2] = parts[2], parts[1]
        return parts, "message 2 of a chunked transfer says payload_offset = %d" % start
    if damage == "duplicated":
        return [*parts[:3], parts[2], *parts[3:]], "message 4 .* repeats or overlaps"
    if damage == "missing":
        return [*parts[:2], *parts[3:]], "message 3 .* leaves bytes %d-" % start
    if damage == "overlapping":
        parts[2] = later(start - 100, payload_of(parts[1])[-100:] + payload_of(parts[2]))
        return parts, "message 3 .* repeats or overlaps"
    if damage == "no offset (an old client)":
        parts[1] = frame(pb.InsertRequest(), [payload_of(parts[1])])
        return parts, "message 2 of a chunked transfer has no payload_offset"
    return parts, "declared 1000"


@pytest.mark.parametrize("damage", ["header in a later message", "more than announced",
                                    "ends early", "a message over what was declared",
                                    "reordered", "duplicated", "missing", "overlapping",
                                    "no offset (an old client)"])
def test_a_malformed_chunk_stream_is_refused_storing_nothing(channel, client, damage) -> None:
    """Raw InsertChunks calls whose messages are damaged, reordered, repeated or lost: each
    is refused naming the message at fault, and the table is as it was (the offsets make
    the order checked: before them a reordered stream was stored, its rows scrambled)."""
    parts, says = damaged(good_parts(), damage)
    declared = 1000 if damage == "a message over what was declared" else None
    before = client.info()["frames"]
    error = rpc_error(lambda: chunked_call(channel, parts, declared))
    assert isinstance(error, errors.MalformedRequestError), error
    assert re.search(says, str(error)), error
    after = client.info()["frames"]
    assert (after.size, after.counters["inserted"]) == (before.size, before.counters["inserted"])
    assert wait_for(lambda: client.server_info().limits["memory_in_use_bytes"] == 0)


def test_a_reordered_chunked_publish_is_refused_keeping_the_variable(channel, client) -> None:
    state = {"w": torch.arange(800_000, dtype=torch.float32)}  # 3.2 MB: four messages
    version = client.publish("ordered", state)
    header, buffers = variable_codec.publish_parts("ordered", {"w": -state["w"]})
    parts = frame_chunks(header, buffers, 900_000)
    parts[1], parts[2] = parts[2], parts[1]
    publish = channel.stream_unary("/replay.v1.ReplayService/PublishChunks")
    error = rpc_error(lambda: publish(iter(parts), timeout=30, metadata=(
        ("replay-request-bytes", str(max(map(len, parts)))),)))
    assert isinstance(error, errors.MalformedRequestError), error
    assert "message 2 of a chunked transfer" in str(error)
    fetched = client.fetch("ordered")
    assert fetched.version == version and torch.equal(fetched["w"], state["w"])


def test_a_chunked_insert_larger_than_the_budget_is_refused_naming_it(client) -> None:
    data = {"pixels": torch.zeros(4000, *ROW, dtype=torch.uint8),  # 62.5 MiB: over 3/4 of 64
            "step": torch.zeros(4000, dtype=torch.int64)}
    with pytest.raises(errors.LimitExceededError, match="server.memory_budget_mb"):
        client.insert("frames", data)


def test_chunked_calls_give_their_memory_back(client) -> None:
    client.insert("frames", frames(0, 300))
    client.sample("frames", 200)
    assert wait_for(lambda: client.server_info().limits["memory_in_use_bytes"] == 0)
