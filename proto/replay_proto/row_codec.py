"""Read and Write bodies of replay.v1 (rows by position or id), encoded and decoded in one place.

``Read`` answers with the rows' columns, their ids and, when asked, their
priorities; ``Write`` carries whole rows and the positions they replace.
The server decodes what the client encodes and the other way round, through
these functions only (layout: :mod:`replay_proto.codec`). Decoders raise
:class:`~replay_proto.codec.CodecError` on anything malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from replay_proto.codec import (
    CodecError,
    decode_tensor_list,
    decode_tensors,
    encode_tensors,
    expect_end,
    fixed_array,
    frame,
    spec_of,
    split_payload,
    tensor_bytes,
)
from replay_proto.v1 import replay_pb2 as pb


@dataclass(frozen=True, slots=True)
class RowsRead:
    """A decoded Read answer.

    Attributes:
        columns: flat key -> ``[n, ...]`` tensors (empty when columns were not asked for).
        ids: int64 ``[n]``.
        priorities: float64 ``[n]``, or ``None`` when not asked for.
        size: rows the table held when it was read.
    """

    columns: dict[str, torch.Tensor]
    ids: torch.Tensor
    priorities: torch.Tensor | None
    size: int


def encode_read_response(columns: Mapping[str, torch.Tensor] | None, ids: np.ndarray,
                         priorities: np.ndarray | None, size: int) -> bytes:
    specs, buffers = encode_tensors({k: v.cpu() for k, v in (columns or {}).items()})
    id_tensor = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64).reshape(-1))
    header = pb.ReadResponse(columns=specs, ids=spec_of("ids", id_tensor), size=size)
    buffers.append(tensor_bytes(id_tensor))
    if priorities is not None:
        values = torch.from_numpy(np.ascontiguousarray(priorities, dtype=np.float64).reshape(-1))
        header.priorities.CopyFrom(spec_of("priorities", values))
        buffers.append(tensor_bytes(values))
    return frame(header, buffers)


def decode_read_response(raw: bytes) -> RowsRead:
    """The answer's tensors, as fresh tensors (the message's bytes are not kept)."""
    header, payload = split_payload(raw, pb.ReadResponse)
    columns, offset = decode_tensors(header.columns, payload)
    specs = [header.ids] + ([header.priorities] if header.HasField("priorities") else [])
    extras, offset = decode_tensor_list(specs, payload, offset)
    expect_end(payload, offset)
    ids = extras[0]
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise CodecError(f"Read: ids must be int64 [n], got {ids.dtype} {list(ids.shape)}")
    for key, column in columns.items():
        if column.dim() == 0 or column.shape[0] != ids.shape[0]:
            raise CodecError(f"Read: column {key!r} has {list(column.shape)} for {ids.shape[0]} "
                             f"rows")
    priorities = extras[1].clone() if len(extras) > 1 else None
    return RowsRead({k: v.clone() for k, v in columns.items()}, ids.clone(), priorities,
                    int(header.size))


@dataclass(frozen=True, slots=True)
class WriteCall:
    """A decoded Write: columns are read-only views of the request bytes."""

    table: str
    columns: dict[str, torch.Tensor]
    positions: np.ndarray


def encode_write(table: str, positions: np.ndarray, columns: Mapping[str, torch.Tensor]) -> bytes:
    specs, buffers = encode_tensors(columns)
    flat = np.ascontiguousarray(positions, dtype="<i8").reshape(-1)
    buffers.append(memoryview(flat).cast("B"))
    return frame(pb.WriteRequest(table=table, columns=specs, count=flat.size), buffers)


def decode_write(raw: bytes) -> WriteCall:
    header, payload = split_payload(raw, pb.WriteRequest)
    columns, offset = decode_tensors(header.columns, payload)
    positions, offset = fixed_array(payload, offset, header.count, "int64")
    expect_end(payload, offset)
    return WriteCall(header.table, columns, positions)
