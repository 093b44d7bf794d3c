"""The one SampleResponse codec: batches, chunks and groups round trip; decoding lands in
caller-provided buffers (a learner's staging ring) or in shared-memory views; malformed or
out-of-order messages are refused with a CodecError.

``replay_client``'s network stream runs this decoder (``test_the_client_stream_runs_this_decoder``).
"""

from __future__ import annotations

import pytest
import torch

from replay_proto.batch import SampleBatch
from replay_proto.codec import CodecError, frame
from replay_proto.sample_codec import (
    SampleDecoder,
    decode_sample,
    encode_ring_batch,
    encode_sample,
    split_sample,
    with_note,
    with_offer,
)
from replay_proto.v1 import replay_pb2 as pb
from tests.proto.test_codec import assert_batches_equal, row_batch


def decode_all(decoder: SampleDecoder, chunks: list[bytes]) -> list[SampleBatch]:
    out = []
    for chunk in chunks:
        out.extend(decoder.add(*split_sample(chunk)))
    return out


def test_a_one_chunk_sample_round_trips_nested_data_and_extras() -> None:
    batch = row_batch()
    [raw] = encode_sample(batch, 0, 1 << 20)
    assert_batches_equal(decode_sample(raw), batch)


def test_a_slice_sample_round_trips_two_dimensional_ids() -> None:
    batch = SampleBatch(data={"obs": torch.arange(24, dtype=torch.float32).reshape(3, 4, 2)},
                        ids=torch.arange(12, dtype=torch.int64).reshape(3, 4),
                        weights=torch.ones(3), probabilities=torch.full((3,), 1 / 3,
                                                                        dtype=torch.float64))
    [raw] = encode_sample(batch, 0, 1 << 20)
    assert_batches_equal(decode_sample(raw), batch)


def test_columns_named_like_the_extras_travel_beside_them() -> None:
    ids = torch.arange(4, dtype=torch.int64)
    batch = SampleBatch({"ids": ids * 10, "weights": ids.float()}, ids, torch.ones(4),
                        torch.full((4,), 0.25, dtype=torch.float64))
    decoded = decode_sample(encode_sample(batch, 0, 1 << 20)[0])
    assert torch.equal(decoded.columns["ids"], ids * 10)
    assert torch.equal(decoded.ids, ids)


# ------------------------------------------------------------- chunked batches


def test_small_chunk_limit_splits_a_batch_into_several_messages() -> None:
    chunks = encode_sample(row_batch(10), 0, 64)
    assert len(chunks) > 1
    headers = [split_sample(c)[0] for c in chunks]
    assert [h.last_chunk for h in headers] == [False] * (len(chunks) - 1) + [True]
    assert all(h.batch_rows == 10 for h in headers)


def test_chunks_cover_the_rows_in_order_contiguously() -> None:
    headers = [split_sample(c)[0] for c in encode_sample(row_batch(10), 0, 64)]
    expected_start = 0
    for header in headers:
        assert header.row_start == expected_start
        expected_start += header.ids.shape[0]
    assert expected_start == 10


def test_decoder_rebuilds_a_chunked_batch_in_row_order() -> None:
    batch = row_batch(10)
    decoder = SampleDecoder()
    chunks = encode_sample(batch, 0, 64)
    results = [decoder.add(*split_sample(c)) for c in chunks]
    assert all(r == [] for r in results[:-1])
    assert_batches_equal(results[-1][0], batch)


def test_decoder_rebuilds_consecutive_batches_of_a_stream() -> None:
    first, second = row_batch(6), row_batch(6)
    second = SampleBatch(second.data, second.ids + 1000, second.weights, second.probabilities)
    chunks = [c for i, b in enumerate((first, second)) for c in encode_sample(b, i, 40)]
    out = decode_all(SampleDecoder(6), chunks)
    assert len(out) == 2
    assert_batches_equal(out[0], first)
    assert_batches_equal(out[1], second)


@pytest.mark.parametrize("chunk_bytes", [1, 40, 1 << 20])
def test_a_group_is_split_into_its_batches_whatever_the_chunking(chunk_bytes: int) -> None:
    group = row_batch(12)  # 3 batches of 4 drawn at once
    out = decode_all(SampleDecoder(4), encode_sample(group, 5, chunk_bytes, batch_count=3))
    assert len(out) == 3
    for i, batch in enumerate(out):
        assert batch.ids.tolist() == group.ids[4 * i : 4 * i + 4].tolist()
        assert torch.equal(batch.columns["obs.state"], group.columns["obs.state"][4 * i : 4 * i + 4])


def test_batches_are_decoded_into_the_buffers_the_caller_provides() -> None:
    provided: dict[int, list[torch.Tensor]] = {}

    def allocate(index, layout):
        provided[index] = [torch.full(shape, -1).to(dtype) for dtype, shape in layout]
        return provided[index]

    group = row_batch(8)
    out = decode_all(SampleDecoder(4, allocate=allocate),
                     encode_sample(group, 10, 64, batch_count=2))
    assert sorted(provided) == [10, 11]  # one set of buffers per batch index of the group
    for index, batch in zip((10, 11), out):
        assert all(a is b for a, b in zip(batch.tensors(), provided[index]))
    assert out[1].ids.tolist() == group.ids[4:].tolist()


def test_decoded_batch_is_independent_of_the_message_bytes() -> None:
    batch = decode_sample(bytes(bytearray(encode_sample(row_batch(4), 0, 1 << 20)[0])))
    batch.ids.add_(1)  # writable, owned by the caller
    assert batch.ids.tolist() == [101, 102, 103, 104]


def test_a_group_whose_rows_do_not_fit_its_batches_is_refused() -> None:
    with pytest.raises(CodecError, match="cannot have"):
        decode_all(SampleDecoder(4), encode_sample(row_batch(10), 0, 1 << 20, batch_count=3))


# ------------------------------------------------------------- order and completeness


def test_out_of_order_chunk_raises_codec_error() -> None:
    chunks = encode_sample(row_batch(10), 0, 64)
    assert len(chunks) >= 3
    decoder = SampleDecoder()
    decoder.add(*split_sample(chunks[0]))
    with pytest.raises(CodecError, match="out of order"):
        decoder.add(*split_sample(chunks[2]))


def test_chunk_without_its_batch_start_raises_codec_error() -> None:
    chunks = encode_sample(row_batch(10), 0, 64)
    with pytest.raises(CodecError, match="out of order"):
        SampleDecoder().add(*split_sample(chunks[1]))


def test_chunk_of_another_batch_mid_batch_raises_codec_error() -> None:
    first = encode_sample(row_batch(10), 0, 64)
    other = encode_sample(row_batch(10), 1, 64)
    decoder = SampleDecoder()
    decoder.add(*split_sample(first[0]))
    with pytest.raises(CodecError, match="batch 1"):
        decoder.add(*split_sample(other[1]))


def test_batch_that_ends_early_raises_codec_error_naming_the_rows() -> None:
    chunks = encode_sample(row_batch(4), 0, 1)  # one row per chunk
    header, payload = split_sample(chunks[2])
    header.last_chunk = True
    forged = frame(header, [payload])
    decoder = SampleDecoder()
    decoder.add(*split_sample(chunks[0]))
    decoder.add(*split_sample(chunks[1]))
    with pytest.raises(CodecError, match="ended after 3 of 4 rows"):
        decoder.add(*split_sample(forged))


def test_a_chunk_with_more_rows_than_its_batch_is_refused() -> None:
    header, payload = split_sample(encode_sample(row_batch(4), 0, 1 << 20)[0])
    header.batch_rows = 2
    with pytest.raises(CodecError, match="too many rows"):
        SampleDecoder().add(*split_sample(frame(header, [payload])))


def test_unary_decode_of_a_partial_batch_raises_codec_error() -> None:
    chunks = encode_sample(row_batch(10), 0, 64)
    with pytest.raises(CodecError, match="whole batch"):
        decode_sample(chunks[0])


# ------------------------------------------------------------- shared-memory descriptors


def ring_message(batch: SampleBatch, slot: int = 3) -> tuple[bytes, list[int]]:
    tensors = batch.tensors()
    offsets = [64 * i for i in range(len(tensors))]
    return encode_ring_batch(batch.columns, list(batch.extras), 7, slot, offsets), offsets


def test_a_ring_batch_is_read_through_the_callers_view_function() -> None:
    batch = row_batch(4)
    raw, offsets = ring_message(batch)
    by_offset = dict(zip(offsets, batch.tensors()))
    seen = []

    def view(slot, offset, dtype, shape):
        seen.append(slot)
        tensor = by_offset[offset]
        assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape)
        return tensor

    [decoded] = SampleDecoder(4, ring_view=view).add(*split_sample(raw))
    assert seen == [3] * len(offsets)
    assert_batches_equal(decoded, batch)


def test_a_ring_batch_without_a_ring_is_refused() -> None:
    raw, _ = ring_message(row_batch(4))
    with pytest.raises(CodecError, match="no ring is mapped"):
        SampleDecoder(4).add(*split_sample(raw))


def test_a_ring_descriptor_that_does_not_fit_is_a_codec_error() -> None:
    raw, _ = ring_message(row_batch(4))

    def view(slot, offset, dtype, shape):
        raise ValueError("does not fit a slot")

    with pytest.raises(CodecError, match="bad shared-memory descriptor"):
        SampleDecoder(4, ring_view=view).add(*split_sample(raw))


def test_a_ring_message_with_the_wrong_number_of_offsets_is_refused() -> None:
    header, _ = split_sample(ring_message(row_batch(4))[0])
    del header.shared_memory.offsets[-1]
    with pytest.raises(CodecError, match="offsets for"):
        SampleDecoder(4, ring_view=lambda *a: None).add(*split_sample(header.SerializeToString()))


def test_offers_and_notes_ride_on_the_first_chunk() -> None:
    [chunk] = encode_sample(row_batch(2), 0, 1 << 20)
    offer = pb.SharedMemoryOffer(name="replay-1-00", slots=3, slot_bytes=4096, header_bytes=4096)
    header, payload = split_sample(with_note(with_offer(chunk, offer), "why"))
    assert header.shared_memory_offer == offer and header.transport_note == "why"
    assert_batches_equal(SampleDecoder().add(header, payload)[0], row_batch(2))


def test_the_client_stream_runs_this_decoder() -> None:
    import ast
    import inspect

    import replay_client.stream as stream

    tree = ast.parse(inspect.getsource(stream))
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "replay_proto.sample_codec" for alias in node.names}
    assert "SampleDecoder" in names
    decoders = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                and "Decoder" in n.name]
    assert decoders == [], "the client must not grow a decoder of its own"
