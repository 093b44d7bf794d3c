"""The wire codec without a server: round trips of every dtype and shape, chunked
sample batches reassembled in order, and every malformed message refused with a
:class:`CodecError` that names the key or the problem.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from replay_proto import messages
from replay_proto.batch import SampleBatch
from replay_proto.codec import (
    CodecError,
    decode_tensors,
    encode_tensors,
    expect_end,
    fixed_array,
    frame,
    split_payload,
)
from replay_proto.dtypes import DTYPES
from replay_proto.keys import flatten, unflatten
from replay_proto.sample_codec import decode_sample, encode_sample
from replay_proto.v1 import replay_pb2 as pb
from tests.wire import encode_insert

PAYLOAD_TAG = bytes([(15 << 3) | 2])


def column(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with varied (not all-zero) values."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=generator,
                         dtype=torch.int64).to(dtype)


def roundtrip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    specs, buffers = encode_tensors(tensors)
    payload = memoryview(b"".join(bytes(b) for b in buffers))
    decoded, end = decode_tensors(specs, payload)
    expect_end(payload, end)
    return decoded


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | 0x80 if value else byte)
        if not value:
            return bytes(out)


def insert_message(specs: list[pb.TensorSpec], payload: bytes, **fields) -> bytes:
    header = pb.InsertRequest(table="t", columns=specs, **fields)
    return frame(header, [payload])


def spec(key: str, dtype: str, shape: list[int]) -> pb.TensorSpec:
    return pb.TensorSpec(key=key, dtype=dtype, shape=shape)


def row_batch(rows: int = 10) -> SampleBatch:
    return SampleBatch(
        data={"obs": {"pixels": torch.arange(rows * 4, dtype=torch.uint8).reshape(rows, 2, 2),
                      "state": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)},
              "action": torch.arange(rows, dtype=torch.int64) * 7},
        ids=torch.arange(100, 100 + rows, dtype=torch.int64),
        weights=torch.linspace(0.1, 1.0, rows, dtype=torch.float32),
        probabilities=torch.linspace(0.01, 0.1, rows, dtype=torch.float64),
    )


def assert_batches_equal(a: SampleBatch, b: SampleBatch) -> None:
    flat_a, flat_b = flatten(a.data), flatten(b.data)
    assert list(flat_a) == list(flat_b)
    for key in flat_a:
        assert flat_a[key].dtype == flat_b[key].dtype, key
        assert torch.equal(flat_a[key], flat_b[key]), key
    for name in ("ids", "weights", "probabilities"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_round_trips_bit_exactly(name: str) -> None:
    original = column(DTYPES[name], (5, 3))
    decoded = roundtrip({"x": original})["x"]
    assert decoded.dtype == original.dtype and decoded.shape == original.shape
    assert torch.equal(decoded, original)


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_round_trips_through_an_insert_request(name: str) -> None:
    original = column(DTYPES[name], (4, 2), seed=1)
    call = messages.decode_insert(encode_insert("replay", {"x": original}))
    assert call.table == "replay"
    assert torch.equal(call.columns["x"], original)


def test_bfloat16_keeps_its_exact_bits() -> None:
    original = torch.tensor([[1.5, -2.25e-3, 3.0e38, float("inf")]], dtype=torch.bfloat16)
    decoded = roundtrip({"x": original})["x"]
    assert torch.equal(decoded.view(torch.int16), original.view(torch.int16))


def test_non_contiguous_tensor_round_trips_in_logical_order() -> None:
    original = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not original.is_contiguous()
    assert torch.equal(roundtrip({"x": original})["x"], original)


def test_several_columns_keep_their_order_and_values() -> None:
    tensors = {"b": column(torch.float32, (3, 2)), "a": column(torch.int16, (3,)),
               "c": column(torch.bool, (3, 1, 2))}
    decoded = roundtrip(tensors)
    assert list(decoded) == ["b", "a", "c"]
    assert all(torch.equal(decoded[k], tensors[k]) for k in tensors)


def test_nested_keys_round_trip_as_flat_keys_and_back() -> None:
    nested = {"obs": {"pixels": column(torch.uint8, (2, 4, 4)),
                      "state": {"pos": column(torch.float32, (2, 3))}},
              "action": column(torch.int64, (2,))}
    call = messages.decode_insert(encode_insert("t", flatten(nested)))
    assert set(call.columns) == {"obs.pixels", "obs.state.pos", "action"}
    rebuilt = unflatten(call.columns)
    assert torch.equal(rebuilt["obs"]["state"]["pos"], nested["obs"]["state"]["pos"])
    assert torch.equal(rebuilt["obs"]["pixels"], nested["obs"]["pixels"])


def test_zero_row_one_dimensional_column_round_trips() -> None:
    decoded = roundtrip({"y": torch.empty(0, dtype=torch.int64)})["y"]
    assert decoded.shape == (0,) and decoded.dtype == torch.int64




def test_zero_row_columns_round_trip_with_their_row_shape() -> None:
    decoded = roundtrip({"x": torch.empty(0, 3, 2)})["x"]
    assert decoded.shape == (0, 3, 2) and decoded.dtype == torch.float32


def test_rows_with_a_zero_sized_dimension_round_trip() -> None:
    decoded = roundtrip({"x": torch.empty(3, 0)})["x"]
    assert decoded.shape == (3, 0)


def test_zero_row_columns_decode_with_their_row_shape() -> None:
    raw = insert_message([spec("x", "float32", [0, 3, 2])], b"")
    decoded = messages.decode_insert(raw).columns["x"]
    assert decoded.shape == (0, 3, 2) and decoded.dtype == torch.float32


def test_zero_row_insert_with_priorities_decodes_to_empty_priorities() -> None:
    raw = encode_insert("t", {"x": torch.empty(0)}, torch.empty(0))
    call = messages.decode_insert(raw)
    assert call.priorities is not None and call.priorities.shape == (0,)


def test_insert_priorities_round_trip_as_float64() -> None:
    priorities = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float32)
    call = messages.decode_insert(encode_insert("t", {"x": torch.zeros(3, 1)}, priorities))
    assert call.priorities is not None and call.priorities.dtype == torch.float64
    assert torch.equal(call.priorities, priorities.double())


def test_insert_without_priorities_decodes_to_none() -> None:
    call = messages.decode_insert(encode_insert("t", {"x": torch.zeros(2)}))
    assert call.priorities is None


def test_an_encoded_insert_is_an_ordinary_protobuf_message() -> None:
    x, y = column(torch.float32, (2, 3)), column(torch.int64, (2,))
    parsed = pb.InsertRequest.FromString(encode_insert("t", {"x": x, "y": y}))
    assert parsed.table == "t"
    assert [(c.key, c.dtype, list(c.shape)) for c in parsed.columns] == [
        ("x", "float32", [2, 3]), ("y", "int64", [2])]
    assert parsed.payload == x.numpy().tobytes() + y.numpy().tobytes()


def test_a_message_built_by_plain_protobuf_decodes() -> None:
    x = column(torch.int32, (3, 2))
    raw = pb.InsertRequest(table="t", columns=[spec("x", "int32", [3, 2])],
                           payload=x.numpy().tobytes()).SerializeToString()
    assert torch.equal(messages.decode_insert(raw).columns["x"], x)


def test_update_request_round_trips_ids_and_priorities() -> None:
    ids = np.array([3, 1, 2**40], dtype=np.int64)
    priorities = np.array([0.25, 0.0, 7.5])
    table, got_ids, got_priorities = messages.decode_update(
        messages.encode_update("p", ids, priorities))
    assert table == "p"
    assert got_ids.dtype == np.int64 and np.array_equal(got_ids, ids)
    assert got_priorities.dtype == np.float64 and np.array_equal(got_priorities, priorities)


def test_update_request_keeps_the_ids_shape_of_a_slice_batch_and_refuses_a_shape_that_lies(
        ) -> None:
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    raw = messages.encode_update("p", ids, ids.astype(np.float64))
    _, got_ids, got_priorities = messages.decode_update(raw)
    assert got_ids.shape == got_priorities.shape == (3, 4) and np.array_equal(got_ids, ids)
    header = pb.UpdatePrioritiesRequest.FromString(raw)
    assert list(header.shape) == [3, 4]
    assert messages.update_arrays(header)[0].shape == (3, 4)  # the update stream's way
    flat = pb.UpdatePrioritiesRequest.FromString(messages.encode_update("p", ids[0], ids[0]))
    assert list(flat.shape) == []  # one dimension: sent as before
    header.shape[:] = [5, 4]
    with pytest.raises(CodecError, match=r"shape \[5, 4\] does not hold its 12 ids"):
        messages.decode_update(header.SerializeToString())


def test_insert_response_decodes_to_consecutive_ids() -> None:
    ids = messages.decode_insert_response(messages.encode_insert_response(41, 3))
    assert ids.dtype == torch.int64 and ids.tolist() == [41, 42, 43]


# ------------------------------------------------------------- malformed input


def test_unknown_dtype_raises_naming_the_key_and_dtype() -> None:
    raw = insert_message([spec("obs", "float128", [1])], b"\0" * 16)
    with pytest.raises(CodecError, match=r"key 'obs': unknown dtype 'float128'"):
        messages.decode_insert(raw)


def test_negative_dimension_raises_naming_the_key_and_shape() -> None:
    raw = insert_message([spec("obs", "float32", [2, -3])], b"")
    with pytest.raises(CodecError, match=r"key 'obs': negative dimension in shape \[2, -3\]"):
        messages.decode_insert(raw)


def test_payload_too_short_raises_naming_the_key_and_byte_counts() -> None:
    raw = insert_message([spec("obs", "float32", [2, 3])], b"\0" * 20)
    with pytest.raises(CodecError, match=r"key 'obs'.*needs 24 bytes.*has 20 left"):
        messages.decode_insert(raw)


def test_payload_too_long_raises_naming_both_lengths() -> None:
    raw = insert_message([spec("obs", "float32", [2, 3])], b"\0" * 28)
    with pytest.raises(CodecError, match="payload has 28 bytes but the tensors described need 24"):
        messages.decode_insert(raw)


def test_second_column_past_the_payload_end_names_that_key() -> None:
    raw = insert_message([spec("a", "int8", [2]), spec("b", "int64", [2])], b"\0" * 10)
    with pytest.raises(CodecError, match="key 'b'"):
        messages.decode_insert(raw)


def test_repeated_key_raises_naming_it() -> None:
    raw = insert_message([spec("a", "int8", [2]), spec("a", "int8", [2])], b"\0" * 4)
    with pytest.raises(CodecError, match="key 'a' appears twice"):
        messages.decode_insert(raw)


def test_two_payload_fields_raise_codec_error() -> None:
    raw = insert_message([spec("a", "int8", [2])], b"\0\0") + PAYLOAD_TAG + b"\x02\0\0"
    with pytest.raises(CodecError, match="two payload fields"):
        messages.decode_insert(raw)


def test_truncated_message_raises_codec_error() -> None:
    raw = insert_message([spec("a", "float32", [4])], b"\0" * 16)
    with pytest.raises(CodecError, match="truncated"):
        messages.decode_insert(raw[:-5])


def test_message_ending_inside_a_varint_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="ends inside a varint"):
        messages.decode_insert(b"\x08\x80")


def test_overlong_varint_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="varint longer than 10 bytes"):
        messages.decode_insert(b"\x08" + b"\xff" * 11 + b"\x01")


@pytest.mark.parametrize("wire_type", [3, 4, 6, 7])
def test_unsupported_wire_type_raises_naming_it(wire_type: int) -> None:
    with pytest.raises(CodecError, match=f"wire type {wire_type}"):
        messages.decode_insert(bytes([(1 << 3) | wire_type]) + b"\0" * 4)


def test_header_protobuf_cannot_parse_raises_codec_error_naming_the_type() -> None:
    raw = b"\x0a\x02\xff\xfe"  # table = invalid UTF-8
    with pytest.raises(CodecError, match="malformed InsertRequest"):
        messages.decode_insert(raw)


def test_garbage_bytes_raise_codec_error() -> None:
    with pytest.raises(CodecError):
        messages.decode_insert(b"\xff\xff\xff\xff\xff not protobuf")


def test_priorities_without_columns_raise_codec_error() -> None:
    raw = frame(pb.InsertRequest(table="t", has_priorities=True), [b"\0" * 8])
    with pytest.raises(CodecError, match="priorities without columns"):
        messages.decode_insert(raw)


def test_has_priorities_without_their_bytes_raises_naming_the_count() -> None:
    raw = insert_message([spec("a", "float32", [3])], b"\0" * 12, has_priorities=True)
    with pytest.raises(CodecError, match="payload too short for 3 float64 values"):
        messages.decode_insert(raw)


def test_update_with_count_larger_than_payload_raises_codec_error() -> None:
    raw = frame(pb.UpdatePrioritiesRequest(table="p", count=5), [b"\0" * 16])
    with pytest.raises(CodecError, match="payload too short for 5 int64 values"):
        messages.decode_update(raw)


def test_update_with_bytes_left_over_raises_codec_error() -> None:
    raw = frame(pb.UpdatePrioritiesRequest(table="p", count=1), [b"\0" * 24])
    with pytest.raises(CodecError, match="payload has 24 bytes but the tensors described need 16"):
        messages.decode_update(raw)


def test_fixed_array_with_negative_count_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="-1 int64"):
        fixed_array(memoryview(b"\0" * 8), 0, -1, "int64")


def test_sample_response_with_short_payload_names_the_extra_tensor() -> None:
    [raw] = encode_sample(row_batch(4), 0, 1 << 20)
    header, payload = split_payload(raw, pb.SampleResponse)
    with pytest.raises(CodecError, match="key 'probabilities'"):
        decode_sample(frame(header, [payload[:-8]]))


def test_zero_byte_shape_whose_dims_overflow_raises_codec_error() -> None:
    raw = insert_message([spec("obs", "float32", [0, 2**62, 2**62])], b"")
    with pytest.raises(CodecError, match="obs"):
        messages.decode_insert(raw)


def test_views_of_read_only_payloads_warn_nothing_even_where_warnings_are_errors() -> None:
    """torch warns (once a process) about a tensor over read-only memory; the decoder, whose
    views of a request are read and then copied, keeps that quiet, and sets a warnings filter
    only for the first such view (a filter a tensor cost more than the view)."""
    script = (
        "import torch\n"
        "from replay_proto.codec import decode_tensor_list, encode_tensors\n"
        "specs, buffers = encode_tensors({'a': torch.arange(6.0), 'b': torch.ones(2, 3)})\n"
        "payload = memoryview(b''.join(bytes(b) for b in buffers))\n"
        "assert payload.readonly\n"
        "for _ in range(3):\n"
        "    tensors, end = decode_tensor_list(specs, payload)\n"
        "    assert tensors[0].tolist() == list(range(6)) and end == len(payload)\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
