"""The write-ahead log's bytes: segment headers, checksummed records, and the scan that reads them.

A segment file ``wal-<index:016d>.log`` begins with a header::

    magic "RPLWAL01" | shard u16 | incarnation u32 | index u64 | crc32 of the above

then holds records, each::

    magic u32 | payload length u64 | crc32 of the payload | crc32 of the 16 bytes before

The payload is ``kind u8 | meta length u32 | meta (JSON) | tensors``, each
tensor ``name | dtype | shape | raw little-endian bytes``; an insert's
compressed column (lz4) is its rows' blocks, each behind its 4-byte size, as
the table stores them (:func:`packed_blocks`, :func:`unpacked_rows`). Nothing is pickled: JSON, raw arrays
and checksums only.

:func:`scan` reads one segment's records and says where they stop: at the
end of the file, or at the first record that is not whole (its header, its
length or its checksum), and whether any whole record can still be found
after that point (which tells a torn tail from damage in the middle; see
:mod:`~replay_server.checkpoint.wal.replay`).

Cost: encoding copies nothing (the tensors' own buffers are written); a
checksum pass over each buffer. Thread-safety: pure functions.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import lz4.block
import numpy as np
import torch

SEGMENT_MAGIC = b"RPLWAL01"
_SEGMENT = struct.Struct("<8sHIQ")
SEGMENT_HEADER_BYTES = _SEGMENT.size + 4
RECORD_MAGIC = 0x31524C57  # "WLR1"
_RECORD = struct.Struct("<IQI")
RECORD_HEADER_BYTES = _RECORD.size + 4
_RECORD_MAGIC_BYTES = struct.pack("<I", RECORD_MAGIC)
_TENSOR = struct.Struct("<HBB")  # name length, dtype length, dims

INSERT, PRIORITIES, RESET, DELETE, PUBLISH, TAKE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {INSERT: "insert", PRIORITIES: "priority update", RESET: "reset",
              DELETE: "delete", PUBLISH: "publish", TAKE: "queue take"}


class LogFormatError(ValueError):
    """A segment header or a record payload is not what this server writes."""


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    shard: int
    incarnation: int
    index: int


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record: its kind, its JSON meta and its named tensors (CPU)."""

    kind: int
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    offset: int  # where it starts in its segment


@dataclass(frozen=True, slots=True)
class Scan:
    """The whole records of a segment and where they stop.

    ``end``: the offset after the last whole record; ``size``: the file's
    size (``end < size``: something follows that is not a whole record);
    ``resumes``: the offset of a whole record found after ``end`` (``None``:
    none, so what follows ``end`` is a torn tail); ``problem``: what is wrong at ``end``.
    """

    records: list[tuple[int, memoryview]]  # (offset, payload: a view into the bytes scanned)
    end: int
    size: int
    resumes: int | None
    problem: str


def segment_name(index: int) -> str:
    return f"wal-{index:016d}.log"


def segment_header(shard: int, incarnation: int, index: int) -> bytes:
    head = _SEGMENT.pack(SEGMENT_MAGIC, shard, incarnation, index)
    return head + struct.pack("<I", zlib.crc32(head))


def read_segment_header(data: bytes) -> SegmentHeader:
    """Raises LogFormatError: too short, another magic, or a checksum that does not match."""
    if len(data) < SEGMENT_HEADER_BYTES:
        raise LogFormatError(f"its header is cut short ({len(data)} of "
                             f"{SEGMENT_HEADER_BYTES} bytes)")
    head = data[:_SEGMENT.size]
    magic, shard, incarnation, index = _SEGMENT.unpack(head)
    if magic != SEGMENT_MAGIC:
        raise LogFormatError(f"it is not a write-ahead log segment (magic {magic!r})")
    (crc,) = struct.unpack_from("<I", data, _SEGMENT.size)
    if crc != zlib.crc32(head):
        raise LogFormatError("its header's checksum does not match")
    return SegmentHeader(shard, incarnation, index)


def encode(kind: int, meta: dict[str, Any], tensors: dict[str, Any] | None = None) -> list[Any]:
    """A record as buffers to write in order (the tensors' own memory: keep them unchanged
    until written). ``tensors``: name -> tensor or array (copied to the host if on a device)."""
    body: list[Any] = []
    for name, value in (tensors or {}).items():
        tensor = _host(value)
        dtype = str(tensor.dtype).removeprefix("torch.").encode()
        key = name.encode()
        body.append(_TENSOR.pack(len(key), len(dtype), tensor.dim()) + key + dtype
                    + struct.pack(f"<{tensor.dim()}qQ", *tensor.shape, tensor.nbytes))
        if tensor.nbytes:
            body.append(memoryview(tensor.view(torch.uint8).numpy()).cast("B")
                        if tensor.dim() else tensor.reshape(1).view(torch.uint8).numpy().tobytes())
    meta_bytes = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    body.insert(0, struct.pack("<BI", kind, len(meta_bytes)) + meta_bytes)
    length = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in body)
    crc = 0
    for buffer in body:
        crc = zlib.crc32(buffer, crc)
    head = _RECORD.pack(RECORD_MAGIC, length, crc)
    return [head + struct.pack("<I", zlib.crc32(head)), *body]


def _host(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
    else:
        array = np.ascontiguousarray(value)
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor.contiguous()


def decode(payload: bytes | bytearray | memoryview, offset: int) -> Record:
    """Raises LogFormatError: the payload (whose checksum matched) is not a record we write.

    The tensors are views into ``payload`` when it is writable (a ``bytearray`` or a view
    of one: what replay reads segments into; no copy), else copies."""
    try:
        view = memoryview(payload)
        if view.readonly:
            view = memoryview(bytearray(view))
        kind, meta_len = struct.unpack_from("<BI", view, 0)
        at = 5 + meta_len
        meta = json.loads(bytes(view[5:at]))
        tensors = {}
        while at < len(view):
            name_len, dtype_len, dims = _TENSOR.unpack_from(view, at)
            at += _TENSOR.size
            name = bytes(view[at:at + name_len]).decode()
            at += name_len
            dtype = getattr(torch, bytes(view[at:at + dtype_len]).decode())
            at += dtype_len
            *shape, nbytes = struct.unpack_from(f"<{dims}qQ", view, at)
            at += 8 * dims + 8
            if at + nbytes > len(view):
                raise ValueError(f"a tensor of {nbytes} bytes runs past the record")
            if nbytes:
                itemsize = torch.empty(0, dtype=dtype).element_size()
                flat = torch.frombuffer(view, dtype=dtype, count=nbytes // itemsize, offset=at)
            else:
                flat = torch.empty(0, dtype=dtype)
            at += nbytes
            tensors[name] = flat.reshape(shape)
    except (struct.error, ValueError, AttributeError, RuntimeError, UnicodeDecodeError) as exc:
        raise LogFormatError(f"a record at offset {offset} cannot be decoded: {exc}") from None
    if kind not in KIND_NAMES or not isinstance(meta, dict):
        raise LogFormatError(f"a record at offset {offset} has unknown kind {kind}")
    return Record(kind, meta, tensors, offset)


def packed_blocks(blocks: list[bytes]) -> np.ndarray:
    """A compressed column's rows as one buffer: each row's block behind its 4-byte size, as
    the table stores them (:func:`~replay_server.engine.storage.lz4_batch.prefixed`)."""
    return np.frombuffer(b"".join(blocks), dtype=np.uint8)


def unpacked_rows(packed: torch.Tensor, dtype: str, shape: list[int], rows: int) -> torch.Tensor:
    """The rows of :func:`packed_blocks`' buffer, decompressed: ``[rows, *shape]`` of ``dtype``.

    Raises:
        LogFormatError: the buffer does not hold ``rows`` whole blocks of that size.
    """
    try:
        torch_dtype = getattr(torch, dtype)
        row_bytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=torch_dtype).element_size()
        data = memoryview(packed.numpy())
        out = np.empty((rows, row_bytes), dtype=np.uint8)
        at = 0
        for row in range(rows):
            size = int.from_bytes(data[at:at + 4], "little")
            out[row] = np.frombuffer(lz4.block.decompress(
                data[at + 4:at + 4 + size], uncompressed_size=row_bytes), dtype=np.uint8)
            at += 4 + size
        if at != len(data):
            raise ValueError(f"{len(data) - at} bytes follow the last block")
    except (AttributeError, TypeError, ValueError, lz4.block.LZ4BlockError) as exc:
        raise LogFormatError(f"compressed rows cannot be read: {exc}") from None
    return torch.from_numpy(out).view(torch_dtype).reshape(rows, *shape)


def _record_at(data: memoryview, at: int) -> tuple[memoryview, int] | str:
    """The payload of the record at ``at`` (a view, no copy) and the offset after it, or why
    there is none."""
    if len(data) - at < RECORD_HEADER_BYTES:
        return f"a record header cut short ({len(data) - at} bytes)"
    magic, length, crc = _RECORD.unpack_from(data, at)
    (head_crc,) = struct.unpack_from("<I", data, at + _RECORD.size)
    if magic != RECORD_MAGIC or head_crc != zlib.crc32(data[at:at + _RECORD.size]):
        return "a record header that does not check out (bad magic or checksum)"
    start = at + RECORD_HEADER_BYTES
    if start + length > len(data):
        return f"a record cut short ({len(data) - start} of {length} bytes)"
    payload = data[start:start + length]
    if zlib.crc32(payload) != crc:
        return "a record whose checksum does not match"
    return payload, start + length


def scan(data: bytes | bytearray, size: int | None = None) -> Scan:
    """Every whole record of a segment's bytes (header included; its first ``size`` bytes,
    default all), in order; see :class:`Scan`. Cost: one CRC32 pass over the bytes; the
    payloads are views into ``data``."""
    size = len(data) if size is None else size
    view = memoryview(data)[:size]
    records: list[tuple[int, memoryview]] = []
    at = SEGMENT_HEADER_BYTES
    problem = ""
    while at < size:
        found = _record_at(view, at)
        if isinstance(found, str):
            problem = found
            break
        records.append((at, found[0]))
        at = found[1]
    resumes = None
    if at < size:
        probe = data.find(_RECORD_MAGIC_BYTES, at + 1, size)
        while probe != -1:
            if not isinstance(_record_at(view, probe), str):
                resumes = probe
                break
            probe = data.find(_RECORD_MAGIC_BYTES, probe + 1, size)
    return Scan(records, at, size, resumes, problem)
