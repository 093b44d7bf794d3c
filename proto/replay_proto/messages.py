"""Request and response bodies of replay.v1, encoded and decoded in one place.

The server decodes what the client encodes and the other way round; both use
these functions, so the wire format is defined once (see
:mod:`replay_proto.codec` for the layout). Decoders raise
:class:`~replay_proto.codec.CodecError` on anything malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_proto.codec import (
    CodecError,
    copy_rows,
    decode_tensors,
    encode_tensors,
    expect_end,
    fixed_array,
    frame,
    spec_of,
    split_payload,
    tensor_bytes,
)
from replay_proto.keys import flatten, unflatten
from replay_proto.v1 import replay_pb2 as pb

# ------------------------------------------------------------------- insert


@dataclass(frozen=True, slots=True)
class InsertCall:
    """A decoded Insert: columns are read-only views of the request bytes."""

    table: str
    columns: dict[str, torch.Tensor]
    priorities: torch.Tensor | None


def encode_insert(
    table: str, columns: Mapping[str, torch.Tensor], priorities: torch.Tensor | None = None
) -> bytes:
    specs, buffers = encode_tensors(columns)
    if priorities is not None:
        buffers.append(tensor_bytes(priorities.to(torch.float64)))
    header = pb.InsertRequest(table=table, columns=specs, has_priorities=priorities is not None)
    return frame(header, buffers)


def decode_insert(raw: bytes) -> InsertCall:
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
    response = pb.InsertResponse.FromString(raw)
    return torch.arange(response.first_id, response.first_id + response.count, dtype=torch.int64)


# -------------------------------------------------------- update priorities


def encode_update(table: str, ids: np.ndarray, priorities: np.ndarray) -> bytes:
    ids = np.ascontiguousarray(ids, dtype="<i8").reshape(-1)
    priorities = np.ascontiguousarray(priorities, dtype="<f8").reshape(-1)
    header = pb.UpdatePrioritiesRequest(table=table, count=ids.size)
    return frame(header, [memoryview(ids).cast("B"), memoryview(priorities).cast("B")])


def decode_update(raw: bytes) -> tuple[str, np.ndarray, np.ndarray]:
    """``(table, ids int64, priorities float64)`` (read-only views)."""
    header, payload = split_payload(raw, pb.UpdatePrioritiesRequest)
    ids, offset = fixed_array(payload, 0, header.count, "int64")
    priorities, offset = fixed_array(payload, offset, header.count, "float64")
    expect_end(payload, offset)
    return header.table, ids, priorities


# ------------------------------------------------------------------- sample

SAMPLE_EXTRAS = ("ids", "weights", "probabilities")


def encode_sample(
    batch: SampleBatch, batch_index: int, max_chunk_bytes: int, batch_count: int = 1
) -> list[bytes]:
    """``batch`` as one or more SampleResponse messages of at most about ``max_chunk_bytes``.

    Chunks split the batch by rows (dim 0), never inside a row or slice.
    ``batch_count > 1`` marks ``batch`` as a group of that many equal batches
    drawn at once (the receiver splits it).
    """
    columns = flatten(batch.data)
    extras = {"ids": batch.ids, "weights": batch.weights, "probabilities": batch.probabilities}
    rows = batch.batch_size
    per_row = sum(t[:1].numel() * t.element_size() for t in (*columns.values(), *extras.values()))
    rows_per_chunk = max(1, max_chunk_bytes // max(1, per_row))
    messages = []
    for start in range(0, max(rows, 1), rows_per_chunk):
        stop = min(rows, start + rows_per_chunk)
        part = {key: t[start:stop] for key, t in columns.items()}
        specs, buffers = encode_tensors(part)
        extra_specs = {}
        for name, tensor in extras.items():
            extra_specs[name] = spec_of(name, tensor[start:stop])
            buffers.append(tensor_bytes(tensor[start:stop]))
        header = pb.SampleResponse(
            columns=specs,
            batch_index=batch_index,
            row_start=start,
            batch_rows=rows,
            last_chunk=stop == rows,
            batch_count=batch_count,
            **extra_specs,
        )
        messages.append(frame(header, buffers))
    return messages


class BatchAssembler:
    """Rebuilds SampleBatches from SampleResponse chunks (in stream order).

    Each batch is copied once, chunk by chunk, into freshly allocated tensors
    that the caller owns (writable, independent of the message bytes).
    """

    def __init__(self) -> None:
        self._parts: dict[str, torch.Tensor] | None = None
        self._batch_index = -1
        self._next_row = 0
        self._batch_count = 1

    def add_batches(self, raw: bytes) -> list[SampleBatch]:
        """Add one chunk; return the batches it completes (a group split into its batches)."""
        group = self.add(raw)
        if group is None:
            return []
        count = self._batch_count
        if count == 1:
            return [group]
        if group.batch_size % count:
            raise CodecError(f"a group of {group.batch_size} rows cannot hold {count} equal batches")
        size = group.batch_size // count
        columns = flatten(group.data)
        return [
            SampleBatch(
                unflatten({key: t[i * size : (i + 1) * size] for key, t in columns.items()}),
                group.ids[i * size : (i + 1) * size],
                group.weights[i * size : (i + 1) * size],
                group.probabilities[i * size : (i + 1) * size],
            )
            for i in range(count)
        ]

    def add(self, raw: bytes) -> SampleBatch | None:
        """Add one chunk; return the batch (or whole group) it completes, if any."""
        header, payload = split_payload(raw, pb.SampleResponse)
        specs = [*header.columns, header.ids, header.weights, header.probabilities]
        tensors, offset = decode_tensors(specs, payload)
        expect_end(payload, offset)
        if header.row_start == 0:
            self._batch_index, self._next_row = header.batch_index, 0
            self._batch_count = max(1, header.batch_count)
            self._parts = {
                key: torch.empty((header.batch_rows, *t.shape[1:]), dtype=t.dtype)
                for key, t in tensors.items()
            }
        if (
            self._parts is None
            or header.batch_index != self._batch_index
            or header.row_start != self._next_row
        ):
            raise CodecError(
                f"chunk of batch {header.batch_index} at row {header.row_start} arrived out of "
                f"order (expected batch {self._batch_index}, row {self._next_row})"
            )
        rows = 0
        for key, tensor in tensors.items():
            rows = tensor.shape[0]
            copy_rows(self._parts[key], header.row_start, tensor)
        self._next_row += rows
        if not header.last_chunk:
            return None
        if self._next_row != header.batch_rows:
            raise CodecError(f"batch {header.batch_index} ended after {self._next_row} of "
                             f"{header.batch_rows} rows")
        parts, self._parts = self._parts, None
        extras = {name: parts.pop(name) for name in SAMPLE_EXTRAS}
        return SampleBatch(unflatten(parts), extras["ids"], extras["weights"],
                           extras["probabilities"])


def decode_sample(raw: bytes) -> SampleBatch:
    """A batch sent as a single SampleResponse."""
    batch = BatchAssembler().add(raw)
    if batch is None:
        raise CodecError("a unary sample response must hold the whole batch")
    return batch
