"""Chunked transfers: the one writer and the one reader of the form, against the unary form."""

from __future__ import annotations

import pytest
import torch

from replay_proto import messages, variable_codec
from replay_proto.chunks import (
    Reassembly,
    chunk_bytes,
    frame_chunks,
    payload_parts,
    scatter,
)
from replay_proto.codec import CodecError, encode_tensors, frame, split_payload
from replay_proto.v1 import replay_pb2 as pb


def columns(rows: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(rows * 300, dtype=torch.float32).reshape(rows, 300),
            "action": torch.arange(rows, dtype=torch.int64)}


def split_message(raw: bytes, message_type: type, chunk: int) -> list[bytes]:
    """The one-message form ``raw`` (of ``message_type``) as a chunked transfer."""
    header, payload = split_payload(raw, message_type)
    return frame_chunks(header, [payload], chunk)


def encode_fetch(name: str, version: int, tensors: dict[str, torch.Tensor]) -> bytes:
    """A whole (unary) Fetch answer carrying ``tensors``."""
    specs, buffers = encode_tensors(tensors)
    return frame(pb.FetchResponse(found=True, name=name, version=version, tensors=specs), buffers)


def later(offset: int, payload: bytes, **fields) -> bytes:
    """A later message of a transfer: ``payload`` said to start at ``offset``."""
    return frame(pb.InsertRequest(payload_offset=offset, **fields), [payload])


def total(parts: list[bytes]) -> int:
    return pb.InsertRequest.FromString(parts[0]).payload_bytes


def reassembled(parts: list[bytes], message_type: type) -> bytes:
    transfer = Reassembly(parts[0], message_type)
    for part in parts[1:]:
        transfer.add(part)
    return bytes(transfer.message())


@pytest.mark.parametrize("chunk", [200, 1000, 4096, 10_000, 1 << 20])
def test_a_chunked_insert_reassembles_into_what_the_unary_form_decodes_to(chunk: int) -> None:
    data = columns(17)
    priorities = torch.linspace(0.5, 2.0, 17)
    header, buffers = messages.insert_parts("replay", data, priorities)
    parts = frame_chunks(header, buffers, chunk)
    assert all(len(part) <= chunk + 16 for part in parts)  # the payload bytes, plus a tag
    decoded = messages.decode_insert(reassembled(parts, pb.InsertRequest))
    assert decoded.table == "replay"
    for key, value in data.items():
        assert torch.equal(decoded.columns[key], value)
    assert torch.equal(decoded.priorities, priorities.to(torch.float64))


def test_a_request_that_fits_one_message_is_whole_and_read_as_it_is() -> None:
    header, buffers = messages.insert_parts("replay", columns(2))
    parts = frame_chunks(header, buffers, 1 << 20)
    assert len(parts) == 1
    transfer = Reassembly(parts[0], pb.InsertRequest)
    assert transfer.chunked and transfer.complete  # payload_bytes set, all of it in one message
    decoded = messages.decode_insert(reassembled(parts, pb.InsertRequest))
    assert torch.equal(decoded.columns["obs"], columns(2)["obs"])
    unary = frame(header, buffers)  # the unary form: payload_bytes unset
    plain = Reassembly(unary, pb.InsertRequest)
    assert not plain.chunked and plain.message() == unary


def test_split_message_chunks_a_whole_message_and_fetch_decodes_the_parts() -> None:
    state = {"w": torch.randn(1000, 33), "b": torch.randn(7), "step": torch.tensor(3)}
    whole = encode_fetch("policy", 4, state)
    parts = split_message(whole, pb.FetchResponse, 3000)
    assert len(parts) > 10
    answer = variable_codec.decode_fetch_chunks(parts)
    assert (answer.found, answer.name, answer.version) == (True, "policy", 4)
    for key, value in state.items():
        assert torch.equal(answer.tensors[key], value)
        assert answer.tensors[key].is_contiguous()


def test_payload_parts_and_scatter_cover_every_boundary() -> None:
    payload = bytes(range(256)) * 40
    parts = split_message(frame(pb.PublishRequest(name="v"), [payload]), pb.PublishRequest, 333)
    header, views = payload_parts(parts, pb.PublishRequest)
    assert header.name == "v" and header.payload_bytes == len(payload)
    destinations = [bytearray(n) for n in (1, 500, 0, 4000, len(payload) - 4501)]
    scatter(views, [memoryview(d) for d in destinations])
    assert b"".join(destinations) == payload


def test_a_later_message_with_header_fields_is_malformed() -> None:
    header, buffers = messages.insert_parts("replay", columns(40))
    parts = frame_chunks(header, buffers, 5000)
    transfer = Reassembly(parts[0], pb.InsertRequest)
    with pytest.raises(CodecError, match="only payload"):
        transfer.add(later(transfer.received, b"x", table="other"))


def test_more_payload_than_announced_is_malformed() -> None:
    header, buffers = messages.insert_parts("replay", columns(40))
    parts = frame_chunks(header, buffers, 5000)
    transfer = Reassembly(parts[0], pb.InsertRequest)
    for part in parts[1:]:
        transfer.add(part)
    with pytest.raises(CodecError, match="more payload than"):
        transfer.add(later(total(parts), b"x"))
    with pytest.raises(CodecError, match="payload_bytes"):
        payload_parts([*parts, later(total(parts), b"x")], pb.InsertRequest)


def test_a_transfer_that_ends_early_is_malformed() -> None:
    header, buffers = messages.insert_parts("replay", columns(40))
    parts = frame_chunks(header, buffers, 5000)
    transfer = Reassembly(parts[0], pb.InsertRequest)
    transfer.add(parts[1])
    assert not transfer.complete
    with pytest.raises(CodecError, match="ended after"):
        transfer.message()
    with pytest.raises(CodecError, match="payload bytes arrived"):
        payload_parts(parts[:-1], pb.InsertRequest)


def test_a_first_message_announcing_less_than_it_carries_is_malformed() -> None:
    raw = frame(pb.InsertRequest(table="t", payload_bytes=3), [b"0123456789"])
    with pytest.raises(CodecError, match="payload_bytes = 3"):
        Reassembly(raw, pb.InsertRequest)


def test_a_second_message_after_a_whole_one_is_malformed() -> None:
    whole = frame(pb.InsertRequest(table="t"), [b""])
    with pytest.raises(CodecError, match="after a whole one"):
        Reassembly(whole, pb.InsertRequest).add(frame(pb.InsertRequest(), [b"x"]))


def test_a_header_larger_than_a_chunk_cannot_be_sent() -> None:
    header = pb.InsertRequest(table="t" * 5000)
    with pytest.raises(CodecError, match="header alone"):
        frame_chunks(header, [b"x"], 1000)


def test_released_transfers_hold_no_buffer() -> None:
    header, buffers = messages.insert_parts("replay", columns(40))
    parts = frame_chunks(header, buffers, 5000)
    transfer = Reassembly(parts[0], pb.InsertRequest)
    transfer.add(parts[1])
    transfer.release()
    assert transfer.received == 0 and not transfer.complete


def test_chunk_bytes_leave_room_for_the_header() -> None:
    assert chunk_bytes(4 << 20) == (4 << 20) - 64 * 1024
    assert chunk_bytes(1) == 1


def chunked_columns() -> list[bytes]:
    header, buffers = messages.insert_parts("replay", columns(40))
    return frame_chunks(header, buffers, 5000)


def offset(part: bytes) -> int:
    return pb.InsertRequest.FromString(part).payload_offset


def test_every_later_message_says_where_its_payload_starts() -> None:
    parts = chunked_columns()
    received = len(split_payload(parts[0], pb.InsertRequest)[1])
    for part in parts[1:]:
        assert offset(part) == received
        received += len(split_payload(part, pb.InsertRequest)[1])
    assert received == total(parts)


@pytest.mark.parametrize("damage, says", [
    ("reordered", "message 2 .* leaves bytes"),
    ("duplicated", "message 3 .* repeats or overlaps"),
    ("missing", "message 2 .* leaves bytes"),
    ("overlapping", "message 3 .* repeats or overlaps"),
    ("no offset", "message 2 .* has no payload_offset"),
])
def test_a_message_out_of_place_is_refused_naming_it(damage: str, says: str) -> None:
    parts = chunked_columns()
    if damage == "reordered":
        parts[1], parts[2] = parts[2], parts[1]
    elif damage == "duplicated":
        parts.insert(2, parts[1])
    elif damage == "missing":
        del parts[1]
    elif damage == "overlapping":
        start = offset(parts[2])
        parts[2] = later(start - 10, b"\0" * 10 + bytes(split_payload(parts[2], pb.InsertRequest)[1]))
    else:
        parts[1] = frame(pb.InsertRequest(), [split_payload(parts[1], pb.InsertRequest)[1]])
    with pytest.raises(CodecError, match=says):
        reassembled(parts, pb.InsertRequest)
    with pytest.raises(CodecError, match=says):
        payload_parts(parts, pb.InsertRequest)


def test_a_first_message_that_does_not_start_at_zero_is_refused() -> None:
    parts = chunked_columns()
    moved = pb.InsertRequest.FromString(parts[0])
    moved.payload_offset = 7
    with pytest.raises(CodecError, match="payload_offset = 7"):
        Reassembly(moved.SerializeToString(), pb.InsertRequest)
