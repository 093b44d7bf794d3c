"""Insert and UpdatePriorities bodies of replay.v1, encoded and decoded in one place.

The server decodes what the client encodes and the other way round; both use
these functions, so the wire format is defined once (see
:mod:`replay_proto.codec` for the layout; sampled batches are in
:mod:`replay_proto.sample_codec`). Decoders raise
:class:`~replay_proto.codec.CodecError` on anything malformed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from replay_proto.codec import (
    CodecError,
    decode_tensors,
    encode_tensors,
    expect_end,
    fixed_array,
    frame,
    split_payload,
    tensor_bytes,
    varint,
)
from replay_proto.v1 import replay_pb2 as pb

_CALL_FIELD_TAGS = {  # CallStreamRequest's requests, as their fields' tags (length-delimited)
    kind: varint((pb.CallStreamRequest.DESCRIPTOR.fields_by_name[kind].number << 3) | 2)
    for kind in ("update_priorities", "insert", "insert_region", "region_answer",
                 "sample_in_region", "local_channel")}

# ------------------------------------------------------------------- insert


@dataclass(frozen=True, slots=True)
class InsertCall:
    """A decoded Insert: columns are read-only views of the request bytes."""

    table: str
    columns: dict[str, torch.Tensor]
    priorities: torch.Tensor | None


def insert_parts(
    table: str, columns: Mapping[str, torch.Tensor], priorities: torch.Tensor | None = None
) -> tuple[pb.InsertRequest, list[memoryview]]:
    """An InsertRequest's header and payload buffers, not yet joined (one message, or
    chunks: :mod:`replay_proto.chunks`)."""
    specs, buffers = encode_tensors(columns)
    if priorities is not None:
        buffers.append(tensor_bytes(priorities.to(torch.float64)))
    header = pb.InsertRequest(table=table, columns=specs, has_priorities=priorities is not None)
    return header, buffers


def decode_insert(raw: bytes | memoryview) -> InsertCall:
    header, payload = split_payload(raw, pb.InsertRequest)
    columns, offset = decode_tensors(header.columns, payload)
    priorities = None
    if header.has_priorities:
        if not columns:
            raise CodecError("priorities without columns")
        rows = next(iter(columns.values())).shape[0] if next(iter(columns.values())).dim() else 0
        values, offset = fixed_array(payload, offset, rows, "float64")
        priorities = torch.from_numpy(values.copy())
    expect_end(payload, offset)
    return InsertCall(header.table, columns, priorities)


def encode_insert_response(first_id: int, count: int) -> bytes:
    return pb.InsertResponse(first_id=first_id, count=count).SerializeToString()


def decode_insert_response(raw: bytes) -> torch.Tensor:
    """The new rows' ids."""
    return insert_ids(pb.InsertResponse.FromString(raw))


def insert_ids(response: pb.InsertResponse) -> torch.Tensor:
    """The new rows' ids an InsertResponse names."""
    first = response.first_id  # numpy's arange: a third of torch's per-call cost
    return torch.from_numpy(np.arange(first, first + response.count, dtype=np.int64))


# -------------------------------------------------------- update priorities


def encode_update(table: str, ids: np.ndarray, priorities: np.ndarray) -> bytes:
    """An UpdatePrioritiesRequest; ids of more than one dimension keep their shape (a slice
    batch's ``[B, slice_len]``: see the message)."""
    shape = list(np.shape(ids)) if np.ndim(ids) > 1 else []
    ids = np.ascontiguousarray(ids, dtype="<i8").reshape(-1)
    priorities = np.ascontiguousarray(priorities, dtype="<f8").reshape(-1)
    header = pb.UpdatePrioritiesRequest(table=table, count=ids.size, shape=shape)
    return frame(header, [memoryview(ids).cast("B"), memoryview(priorities).cast("B")])


def decode_update(raw: bytes) -> tuple[str, np.ndarray, np.ndarray]:
    """``(table, ids int64, priorities float64)`` (read-only views, in the ids' shape)."""
    header, payload = split_payload(raw, pb.UpdatePrioritiesRequest)
    return (header.table, *_update_arrays(payload, header.count, header.shape))


def _update_arrays(payload: memoryview, count: int, shape: Sequence[int] = ()
                   ) -> tuple[np.ndarray, np.ndarray]:
    ids, offset = fixed_array(payload, 0, count, "int64")
    priorities, offset = fixed_array(payload, offset, count, "float64")
    expect_end(payload, offset)
    if shape:
        if any(n < 0 for n in shape) or int(np.prod(shape)) != count:
            raise CodecError(f"UpdatePrioritiesRequest: shape {list(shape)} does not hold "
                             f"its {count} ids")
        ids, priorities = ids.reshape(shape), priorities.reshape(shape)
    return ids, priorities


# ------------------------------------------------------------ call stream


def encode_call_request(sequence: int, kind: str, request: bytes,
                        timeout_s: float | None = None) -> bytes:
    """A CallStream message carrying ``request``: an encoded UpdatePrioritiesRequest
    (``kind`` ``"update_priorities"``), Insert request (``"insert"``), SampleRequest
    (``"sample_in_region"``) or region control message (``"insert_region"``,
    ``"region_answer"``), which may wait
    ``timeout_s`` on the server (``None``: the server's default). One copy of ``request``."""
    header = pb.CallStreamRequest(sequence=sequence, timeout_s=timeout_s or 0.0)
    return b"".join([header.SerializeToString(), _CALL_FIELD_TAGS[kind], varint(len(request)),
                     request])


_CREDIT_UPDATE_TAG = varint((pb.SampleStreamRequest.DESCRIPTOR.fields_by_name["update"].number << 3) | 2)


def encode_credit(credits: int, update: bytes = b"", batches_per_message: int = 0,
                  finished: int = 0) -> bytes:
    """A SampleStream credit message: ``credits`` more batches, after ``update`` (an encoded
    UpdatePrioritiesRequest, or nothing), drawing ``batches_per_message`` at once from now on
    (0: unchanged), ``finished`` more batches finished by the learner (a leased stream's)."""
    header = pb.SampleStreamRequest(credits=credits, batches_per_message=batches_per_message,
                                    finished=finished)
    raw = header.SerializeToString()
    if not update:
        return raw
    return b"".join([raw, _CREDIT_UPDATE_TAG, varint(len(update)), update])


def encode_region_insert(sequence: int, nbytes: int, timeout_s: float | None = None) -> bytes:
    """A CallStream message saying an Insert request of ``nbytes`` lies in the stream's
    shared-memory region (see ``replay.proto``, CallStream)."""
    return pb.CallStreamRequest(sequence=sequence, insert_in_region=nbytes,
                                timeout_s=timeout_s or 0.0).SerializeToString()


def decode_call_request(raw: bytes) -> pb.CallStreamRequest:
    """A CallStream message; raises CodecError if it is malformed or carries no request
    (``WhichOneof("call")`` says which it carries)."""
    try:
        message = pb.CallStreamRequest.FromString(raw)
    except Exception as exc:
        raise CodecError(f"malformed CallStreamRequest: {exc}") from None
    if message.WhichOneof("call") is None:
        raise CodecError("a CallStreamRequest must carry a request (update_priorities, insert, "
                         "insert_region, region_answer, insert_in_region, "
                         "sample_in_region or local_channel)")
    if not message.timeout_s >= 0:  # NaN too
        raise CodecError(f"a CallStreamRequest's timeout_s must be >= 0, not {message.timeout_s}")
    return message


def update_arrays(header: pb.UpdatePrioritiesRequest) -> tuple[np.ndarray, np.ndarray]:
    """A parsed UpdatePrioritiesRequest's ``(ids int64, priorities float64)`` (read-only views)."""
    return _update_arrays(memoryview(header.payload), header.count, header.shape)
