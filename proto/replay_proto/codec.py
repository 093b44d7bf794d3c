"""Tensors on the wire: a small protobuf header plus one raw byte payload.

Every message that carries tensors lists a ``TensorSpec`` (flat key, dtype
name, full shape) per tensor and ends with field 15, ``payload``: the tensors'
raw bytes (little-endian, C order) concatenated in spec order. This module
builds such messages with one copy of the tensor bytes (the final join gRPC
needs) and reads them without copying the payload at all: it walks the
message's top-level fields to find where ``payload`` lies and hands out
``torch.frombuffer`` views into the received bytes, parsing only the small
header with protobuf. The result is an ordinary protobuf message on the wire,
readable by any generated client.

Every malformed input (unknown dtype, negative dims, more than
:data:`MAX_DIMS` dimensions, byte counts that do not match the shapes) raises :class:`CodecError` naming what is wrong.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from replay_proto.dtype_names import ITEMSIZES
from replay_proto.dtypes import DTYPES, dtype_name, numpy_view
from replay_proto.v1 import replay_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
    raise ImportError("replay_proto's wire codec needs a little-endian machine")

PAYLOAD_FIELD = 15
_PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])
_MAX_ELEMENTS = 2**48  # far beyond any message; keeps every size a safe int64
MAX_ENTRIES = 1 << 16
"""Most length-delimited fields (tensor specs, strings) a message's header may hold: each
becomes an object when parsed, so a few bytes on the wire must not become a million of them."""
MAX_DIMS = 64
"""Most dimensions a tensor on the wire may have (numpy's limit: every tensor is read
through numpy views); more is a :class:`CodecError`, refused before anything is built."""


class CodecError(ValueError):
    """A message's tensors are malformed (the message says how)."""


# ----------------------------------------------------------------- encoding


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (made contiguous and CPU first, if needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(numpy_view(t)).cast("B")


def copy_rows(dest: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """``dest[start : start + len(src)] = src`` as one memcpy (no intra-op threads)."""
    np.copyto(numpy_view(dest)[start : start + src.shape[0]], numpy_view(src))


def spec_of(key: str, tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(key=key, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))


def encode_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[pb.TensorSpec], list[memoryview]]:
    """Specs and byte buffers of ``tensors`` (flat keys), in order."""
    specs, buffers = [], []
    for key, tensor in tensors.items():
        specs.append(spec_of(key, tensor))
        buffers.append(tensor_bytes(tensor))
    return specs, buffers


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(header: Any, buffers: Iterable[memoryview | bytes]) -> bytes:
    """Serialize ``header`` (a message whose payload is unset, or its serialized bytes) with
    ``buffers`` as its payload."""
    return b"".join(frame_parts(header, buffers))


def frame_parts(header: Any, buffers: Iterable[memoryview | bytes]) -> list[memoryview | bytes]:
    """:func:`frame`'s message as the parts to write one after another (no copy of the
    buffers: for a writer into memory of its own, e.g. a shared-memory region)."""
    parts = list(buffers)
    size = sum(memoryview(p).nbytes for p in parts)
    head = header if isinstance(header, bytes) else header.SerializeToString()
    return [b"".join([head, _PAYLOAD_TAG, varint(size)]), *parts]


# ----------------------------------------------------------------- decoding


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise CodecError("message ends inside a varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CodecError("varint longer than 10 bytes")


def split_payload(raw: bytes | memoryview, message_type: Any) -> tuple[Any, memoryview]:
    """Parse ``raw`` as ``message_type``, returning ``(header, payload view)``.

    The header is parsed from the bytes outside the payload field; the payload
    is a zero-copy view into ``raw``.
    """
    data = memoryview(raw)
    pos = 0
    start = end = -1
    entries = 0
    while pos < len(data):
        tag_start = pos
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            entries += 1
            if entries > MAX_ENTRIES:
                raise CodecError(f"{message_type.__name__} has more than {MAX_ENTRIES} "
                                 f"entries (tensors, names)")
            if field == PAYLOAD_FIELD:
                if start >= 0:
                    raise CodecError("message has two payload fields")
                start, end, payload_tag = pos, pos + length, tag_start
            pos += length
        else:
            raise CodecError(f"unsupported protobuf wire type {wire_type}")
        if pos > len(data):
            raise CodecError("message is truncated")
    try:
        if start < 0:
            return message_type.FromString(bytes(data)), data[0:0]
        header = bytes(data[:payload_tag]) + bytes(data[end:])
        return message_type.FromString(header), data[start:end]
    except Exception as exc:  # protobuf's DecodeError and friends
        raise CodecError(f"malformed {message_type.__name__}: {exc}") from None


def spec_nbytes(spec: pb.TensorSpec) -> int:
    """Bytes a tensor of ``spec`` occupies; validates dtype and shape."""
    if spec.dtype not in ITEMSIZES:
        raise CodecError(
            f"key {spec.key!r}: unknown dtype {spec.dtype!r}; supported: {', '.join(DTYPES)}"
        )
    if len(spec.shape) > MAX_DIMS:
        raise CodecError(f"key {spec.key[:200]!r}: {len(spec.shape)} dimensions, at most "
                         f"{MAX_DIMS} are allowed")
    elements = 1
    for dim in spec.shape:
        if dim < 0:
            raise CodecError(f"key {spec.key!r}: negative dimension in shape {list(spec.shape)}")
        elements *= max(dim, 1)
        if elements > _MAX_ELEMENTS:
            raise CodecError(f"key {spec.key!r}: shape {list(spec.shape)} is impossibly large")
    return ITEMSIZES[spec.dtype] * (0 if 0 in spec.shape else elements)


def decode_tensor_list(
    specs: Sequence[pb.TensorSpec], payload: memoryview, offset: int = 0
) -> tuple[list[torch.Tensor], int]:
    """Tensors of ``specs`` read from ``payload`` at ``offset``, in order: ``(tensors, end offset)``.

    The tensors are views of ``payload``'s memory (read-only if it is). Raises
    :class:`CodecError` if the payload is too short or a spec is invalid.
    """
    out: list[torch.Tensor] = []
    for spec in specs:
        nbytes = spec_nbytes(spec)
        if offset + nbytes > len(payload):
            raise CodecError(
                f"key {spec.key!r}: shape {list(spec.shape)} of {spec.dtype} needs {nbytes} bytes "
                f"but the payload has {len(payload) - offset} left"
            )
        out.append(_view(payload, offset, nbytes, spec))
        offset += nbytes
    return out, offset


def decode_tensors(
    specs: Sequence[pb.TensorSpec], payload: memoryview, offset: int = 0
) -> tuple[dict[str, torch.Tensor], int]:
    """Like :func:`decode_tensor_list`, keyed by the specs' keys (each key at most once)."""
    keys = [spec.key for spec in specs]
    if len(set(keys)) != len(keys):
        twice = next(key for key in keys if keys.count(key) > 1)
        raise CodecError(f"key {twice!r} appears twice")
    tensors, offset = decode_tensor_list(specs, payload, offset)
    return dict(zip(keys, tensors)), offset


def expect_end(payload: memoryview, offset: int) -> None:
    """Raise unless ``offset`` is exactly the payload's end."""
    if offset != len(payload):
        raise CodecError(
            f"payload has {len(payload)} bytes but the tensors described need {offset}"
        )


_READ_ONLY_WARNED = False
"""Whether torch has had its one warning about a view of read-only memory (it warns once a
process): later views need no filter around them."""


def _view(payload: memoryview, offset: int, nbytes: int, spec: pb.TensorSpec) -> torch.Tensor:
    global _READ_ONLY_WARNED
    dtype = DTYPES[spec.dtype]
    shape = tuple(spec.shape)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    count = nbytes // ITEMSIZES[spec.dtype]
    if _READ_ONLY_WARNED or not payload.readonly:
        return torch.frombuffer(payload, dtype=dtype, count=count, offset=offset).view(shape)
    # A view of an immutable request: read here, copied by whoever keeps it. The filter is
    # set only here (a few microseconds a tensor, and not thread-safe), for torch's warning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)
    _READ_ONLY_WARNED = True
    return flat.view(shape)


def fixed_array(payload: memoryview, offset: int, count: int, dtype: str) -> tuple[np.ndarray, int]:
    """``count`` values of ``dtype`` at ``offset``, as a read-only numpy view."""
    nbytes = count * np.dtype(dtype).itemsize
    if count < 0 or offset + nbytes > len(payload):
        raise CodecError(f"payload too short for {count} {dtype} values")
    return np.frombuffer(payload, dtype=np.dtype(dtype).newbyteorder("<"), count=count,
                         offset=offset), offset + nbytes
