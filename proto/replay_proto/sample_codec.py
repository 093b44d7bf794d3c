"""SampleResponse messages: the one encoder and the one decoder of sampled batches.

Unary ``Sample`` answers with one message holding a whole batch;
``SampleStream`` sends *groups* of ``batch_count`` consecutive batches drawn
at once, each group as one or more chunks of rows (``row_start`` ascending,
contiguous, ``last_chunk`` on the last), or, on a same-host stream, one
message per batch whose tensors lie in a shared-memory ring slot (the
message carries their offsets instead of a payload). ``replay.proto`` states
the order of messages; this module is the only code that reads or writes
their tensor parts.

:class:`SampleDecoder` rebuilds batches from any of these forms, copying
each chunk's rows straight into buffers the caller provides (a learner's
pinned staging ring) or into new tensors, and resolving ring descriptors
through a view function the caller provides (the wire package knows the
descriptor, not the ring). Every malformed or out-of-order message raises
:class:`~replay_proto.codec.CodecError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from replay_proto.batch import EXTRAS, SampleBatch
from replay_proto.codec import (
    CodecError,
    copy_rows,
    decode_tensor_list,
    expect_end,
    frame,
    spec_nbytes,
    spec_of,
    split_payload,
    tensor_bytes,
)
from replay_proto.dtypes import DTYPES
from replay_proto.mass import SamplingMass
from replay_proto.v1 import replay_pb2 as pb

STREAM_CHUNK_BYTES = 4 * 1024 * 1024
"""Tensor bytes per SampleStream message at most (Python gRPC moves 1-4 MB messages fastest)."""

HEADROOM = 64 * 1024
"""Bytes of a message kept free for its header (the rest may carry tensor bytes)."""

Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
"""One batch's tensors as ``(dtype, shape)``: the columns in spec order, then the extras."""

Allocate = Callable[[int, Layout], Sequence[torch.Tensor]]
"""``allocate(batch_index, layout)``: buffers (in layout order) that batch ``batch_index`` is decoded into."""

RingView = Callable[[int, int, torch.dtype, tuple[int, ...]], torch.Tensor]
"""``view(slot, offset, dtype, shape)``: a tensor in a shared-memory ring slot (OSError/ValueError if it does not fit)."""


# ------------------------------------------------------------------ encoding


def encode_sample(
    batch: SampleBatch, batch_index: int, max_chunk_bytes: int, batch_count: int = 1
) -> list[bytes]:
    """``batch`` as one or more SampleResponse messages of at most about ``max_chunk_bytes``.

    Chunks split the batch by rows (dim 0), never inside a row or slice.
    ``batch_count > 1`` marks ``batch`` as a group of that many equal batches
    drawn at once (the receiver splits it).
    """
    columns, extras = batch.columns, batch.extras
    rows = batch.batch_size
    per_row = sum(t[:1].numel() * t.element_size() for t in (*columns.values(), *extras))
    rows_per_chunk = max(1, max_chunk_bytes // max(1, per_row))
    messages = []
    for start in range(0, max(rows, 1), rows_per_chunk):
        stop = min(rows, start + rows_per_chunk)
        specs, buffers = [], []
        for key, tensor in columns.items():
            specs.append(spec_of(key, tensor[start:stop]))
            buffers.append(tensor_bytes(tensor[start:stop]))
        extra_specs: dict[str, Any] = {}
        for name, tensor in zip(EXTRAS, extras):
            extra_specs[name] = spec_of(name, tensor[start:stop])
            buffers.append(tensor_bytes(tensor[start:stop]))
        header = pb.SampleResponse(
            columns=specs, batch_index=batch_index, row_start=start, batch_rows=rows,
            last_chunk=stop == rows, batch_count=batch_count, **extra_specs,
        )
        if stop == rows and batch.mass is not None:
            mass = header.mass
            mass.total, mass.min_positive, mass.count = (
                batch.mass.total, batch.mass.min_positive, batch.mass.count)
        messages.append(frame(header, buffers))
    return messages


def encode_ring_batch(
    columns: Mapping[str, torch.Tensor], extras: Sequence[torch.Tensor], batch_index: int,
    slot: int, offsets: Sequence[int], mass: SamplingMass | None = None,
) -> bytes:
    """A SampleResponse saying batch ``batch_index`` lies in ring slot ``slot`` at ``offsets``.

    ``columns`` and ``extras`` are the tensors as they lie in the slot
    (only their specs travel); ``offsets`` follow the same order; ``mass``:
    the table's sampling mass when the batch was drawn.
    """
    header = pb.SampleResponse(
        columns=[spec_of(key, tensor) for key, tensor in columns.items()],
        batch_index=batch_index,
        batch_rows=int(extras[0].shape[0]),
        last_chunk=True,
        batch_count=1,
        shared_memory=pb.SharedMemoryBatch(slot=slot, offsets=list(offsets)),
        mass=None if mass is None else mass.to_proto(),
        **_extra_specs(extras),
    )
    return header.SerializeToString()


def _extra_specs(extras: Sequence[torch.Tensor]) -> dict[str, Any]:
    return {name: spec_of(name, tensor) for name, tensor in zip(EXTRAS, extras)}


def with_offer(chunk: bytes, offer: pb.SharedMemoryOffer) -> bytes:
    """``chunk`` carrying a shared-memory ``offer`` as well (protobuf merges concatenated messages)."""
    return pb.SampleResponse(shared_memory_offer=offer).SerializeToString() + chunk


def with_note(chunk: bytes, note: str) -> bytes:
    """``chunk`` carrying a ``transport_note`` (why the stream uses gRPC) as well."""
    return pb.SampleResponse(transport_note=note).SerializeToString() + chunk


def with_leased(chunk: bytes) -> bytes:
    """``chunk`` saying that the stream's batches are leased (``SampleResponse.leased``)."""
    return pb.SampleResponse(leased=True).SerializeToString() + chunk


# ------------------------------------------------------------------ decoding


def split_sample(raw: bytes) -> tuple[pb.SampleResponse, memoryview]:
    """A SampleResponse's header and its payload (a view of ``raw``)."""
    return split_payload(raw, pb.SampleResponse)


def decode_sample(raw: bytes) -> SampleBatch:
    """The batch of a unary ``Sample`` answer (one message holding the whole batch)."""
    batches = SampleDecoder().add(*split_sample(raw))
    if len(batches) != 1:
        raise CodecError("a unary sample response must hold exactly one whole batch")
    return batches[0]


def _new_buffers(index: int, layout: Layout) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for dtype, shape in layout]


class SampleDecoder:
    """Rebuilds batches from SampleResponse messages given in stream order.

    Args:
        batch_size: rows (or slices) per batch of the stream; a group is split
            into batches of this many rows. ``None``: taken from each group
            (``batch_rows / batch_count``).
        allocate: the buffers batch ``k`` is decoded into (see :data:`Allocate`);
            default: new tensors the caller owns.
        ring_view: resolves shared-memory batches (see :data:`RingView`);
            default: such a message is refused.
        copy: ``copy(dest, start, src)`` writes ``src`` into rows ``start ...``
            of ``dest`` (default :func:`~replay_proto.codec.copy_rows`; a
            learner's feed passes one that splits large copies across cores).
        views: return each chunk's rows as they arrived, as views of the
            message (or of the ring), instead of whole batches: no copy at
            all, for a reader that takes rows in any grouping (a sharded
            stream's merge). ``allocate`` and ``copy`` are not used then.

    Not thread-safe: one decoder per stream.
    """

    def __init__(self, batch_size: int | None = None, *, allocate: Allocate | None = None,
                 ring_view: RingView | None = None,
                 copy: Callable[[torch.Tensor, int, torch.Tensor], None] = copy_rows,
                 views: bool = False) -> None:
        self._views = views
        self._batch_size = batch_size
        self._allocate = allocate or _new_buffers
        self._ring_view = ring_view
        self._copy = copy
        self._group: int | None = None  # batch_index of the group being received
        self._size = 0
        self._next_row = 0
        self._rows = 0
        self._keys: list[str] = []
        self._slots: list[Sequence[torch.Tensor]] = []

    def add(self, header: pb.SampleResponse, payload: memoryview) -> list[SampleBatch]:
        """Decode one message (from :func:`split_sample`); return the batches it completes."""
        if header.HasField("shared_memory"):
            return [self._ring_batch(header, payload)]
        specs = [*header.columns, header.ids, header.weights, header.probabilities]
        tensors, offset = decode_tensor_list(specs, payload)
        expect_end(payload, offset)
        if header.row_start == 0:
            self._begin(header, tensors)
        if (self._group is None or header.batch_index != self._group
                or header.row_start != self._next_row):
            expected = "a group's first chunk" if self._group is None else (
                f"batch {self._group}, row {self._next_row}")
            raise CodecError(f"chunk of batch {header.batch_index} at row {header.row_start} "
                             f"arrived out of order (expected {expected})")
        rows = {int(t.shape[0]) if t.dim() else -1 for t in tensors}
        if len(rows) != 1 or min(rows) < 0 or self._next_row + min(rows) > self._rows:
            raise CodecError(f"chunk of batch {header.batch_index} at row {header.row_start} "
                             f"has inconsistent or too many rows")
        count = rows.pop()
        if self._views:
            self._next_row += count
            if header.last_chunk:
                self._check_end(header)
            n = len(self._keys)
            mass = SamplingMass.from_proto(header.mass) if header.HasField("mass") else None
            return [SampleBatch.from_flat(dict(zip(self._keys, tensors[:n])), tensors[n:],
                                          mass=mass)]
        self._scatter(header.row_start, count, tensors)
        self._next_row += count
        if not header.last_chunk:
            return []
        self._check_end(header)
        n = len(self._keys)
        mass = SamplingMass.from_proto(header.mass) if header.HasField("mass") else None
        return [SampleBatch.from_flat(dict(zip(self._keys, slot[:n])), slot[n:], mass=mass)
                for slot in self._slots]

    def _check_end(self, header: pb.SampleResponse) -> None:
        if self._next_row != self._rows:
            raise CodecError(f"batch {header.batch_index} ended after {self._next_row} of "
                             f"{self._rows} rows")
        self._group = None

    def _begin(self, header: pb.SampleResponse, tensors: list[torch.Tensor]) -> None:
        count = max(1, header.batch_count)
        size = self._batch_size or (header.batch_rows // count)
        if header.batch_rows < 1 or size < 1 or header.batch_rows != count * size:
            raise CodecError(f"a group of {count} batches of {size} rows cannot have "
                             f"{header.batch_rows} rows")
        keys = [spec.key for spec in header.columns]
        if len(set(keys)) != len(keys):
            raise CodecError(f"a column key appears twice in {keys}")
        if any(t.dim() == 0 for t in tensors):
            raise CodecError("every tensor of a sample needs a leading dimension of rows")
        layout: Layout = tuple((t.dtype, (size, *t.shape[1:])) for t in tensors)
        self._group, self._size, self._next_row, self._rows = header.batch_index, size, 0, header.batch_rows
        self._keys = keys
        if not self._views:
            self._slots = [self._allocate(header.batch_index + i, layout) for i in range(count)]

    def _scatter(self, row_start: int, rows: int, tensors: list[torch.Tensor]) -> None:
        """Copy a chunk's rows into the group's batches (a chunk may span several)."""
        size = self._size
        for j, tensor in enumerate(tensors):
            position = row_start
            while position < row_start + rows:
                batch, row = divmod(position, size)
                n = min(size - row, row_start + rows - position)
                part = tensor[position - row_start : position - row_start + n]
                self._copy(self._slots[batch][j], row, part)
                position += n

    def _ring_batch(self, header: pb.SampleResponse, payload: memoryview) -> SampleBatch:
        if self._ring_view is None:
            raise CodecError("a shared-memory batch arrived but no ring is mapped")
        expect_end(payload, 0)
        specs = [*header.columns, header.ids, header.weights, header.probabilities]
        offsets = header.shared_memory.offsets
        if len(offsets) != len(specs):
            raise CodecError(f"{len(offsets)} offsets for {len(specs)} tensors")
        tensors = []
        for spec, offset in zip(specs, offsets):
            spec_nbytes(spec)  # validates dtype and shape
            try:
                tensors.append(self._ring_view(header.shared_memory.slot, offset,
                                               DTYPES[spec.dtype], tuple(spec.shape)))
            except (OSError, ValueError) as exc:
                raise CodecError(f"bad shared-memory descriptor for {spec.key!r}: {exc}") from None
        n = len(header.columns)
        columns = {spec.key: tensor for spec, tensor in zip(header.columns, tensors[:n])}
        if len(columns) != n:
            raise CodecError("a column key appears twice in a shared-memory batch")
        mass = SamplingMass.from_proto(header.mass) if header.HasField("mass") else None
        return SampleBatch.from_flat(columns, tensors[n:], mass=mass)
