"""Chunked transfers: one request or answer carried by several messages under the message limit.

The server's message limit (``max_message_mb``, a few MiB) bounds what gRPC
reads before any handler runs. A request or answer larger than one message
travels on the ``*Chunks`` RPC beside its unary one, as several messages of
the same type (``replay.proto``, "Chunked transfers"): the first carries
every header field, the start of the payload and ``payload_bytes``, the
whole payload's size; each later one carries only the payload's
continuation (field 15) and ``payload_offset`` (field 13), where that
continuation starts in the whole payload. This module is the one writer
(:func:`frame_chunks`) and the one reader (:class:`Reassembly`) of that form,
for both sides.

**Order is checked, never assumed.** Each later message must start exactly
where the bytes received so far end: a reordered, duplicated, overlapping or
missing message (a proxy or a client bug replaying or dropping one) is refused
naming the message and both offsets, never assembled into a wrong payload.
A later message without ``payload_offset`` (a client from before the field) is
refused the same way; client and server are upgraded together. A checksum of
the whole payload was measured and left out: ``zlib.crc32`` runs at about
1 GB/s here, ten times slower than the copy it would ride on, on both sides,
and the transport (TCP, HTTP/2) already checks the bytes; the offsets catch
every misordering a checksum would.

:func:`payload_parts` reads a whole received transfer as views of its
messages (a decoder then copies each tensor out, as from one message);
:class:`Reassembly` rebuilds the one-message form (the exact bytes the unary
RPC would carry) in one buffer, allocated once the first message said how
large it is, so every decoder of the unary form reads it unchanged. Its size
is known before the buffer exists, so a server reserves it from its budget
first. Every malformed transfer (a later message with header fields, more or
fewer payload bytes than announced, a message out of place) raises
:class:`~replay_proto.codec.CodecError`.

Cost: one copy of the payload on each side (into the messages, out of them),
as the unary form has. Not thread-safe: one :class:`Reassembly` per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from replay_proto.codec import PAYLOAD_FIELD, CodecError, split_payload, varint

CHUNK_HEADROOM = 64 * 1024
"""Bytes of each message kept for its header (the rest of the message limit carries payload)."""

_PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])
OFFSET_FIELD = 13
"""``payload_offset``: where a later message's payload starts in the whole payload."""
_OFFSET_TAG = bytes([OFFSET_FIELD << 3])  # varint


def chunk_bytes(message_limit: int) -> int:
    """Payload bytes one message of a chunked transfer carries under ``message_limit``."""
    return max(1, message_limit - CHUNK_HEADROOM)


def frame_chunks(header: Any, buffers: Iterable[memoryview | bytes], chunk: int) -> list[bytes]:
    """``header`` with ``buffers`` as its payload, as the messages of a chunked transfer.

    Args:
        header: the message's header fields (its payload unset); not modified.
        buffers: the payload, in order.
        chunk: payload bytes per message at most (the first carries fewer: its
            header shares the room).

    Raises:
        CodecError: the header alone does not fit ``chunk`` bytes.
    """
    parts = [memoryview(b).cast("B") for b in buffers]
    total = sum(p.nbytes for p in parts)
    first = type(header)()
    first.CopyFrom(header)
    first.payload_bytes = total
    head = first.SerializeToString()
    if len(head) >= chunk:
        raise CodecError(f"the {type(header).__name__} header alone is {len(head)} bytes, over "
                         f"the {chunk} bytes a message may carry")
    messages: list[bytes] = []
    pieces: list[memoryview] = []
    later = chunk - len(_OFFSET_TAG) - len(varint(total))  # room beside the offset field
    room = chunk - len(head)
    filled = sent = 0
    for part in parts:
        offset = 0
        while offset < part.nbytes:
            take = min(room - filled, part.nbytes - offset)
            pieces.append(part[offset:offset + take])
            offset += take
            filled += take
            if filled == room:
                messages.append(_message(_head(head, messages, sent), pieces, filled))
                sent += filled
                pieces, filled, room = [], 0, max(1, later)
    if filled or not messages:
        messages.append(_message(_head(head, messages, sent), pieces, filled))
    return messages


def _head(first: bytes, messages: list[bytes], offset: int) -> bytes:
    """The fields before a message's payload: the header on the first, the offset on later ones."""
    return first if not messages else _OFFSET_TAG + varint(offset)


def _message(head: bytes, pieces: list[memoryview], size: int) -> bytes:
    return b"".join([head, _PAYLOAD_TAG, varint(size), *pieces])


def first_part(first: bytes, message_type: type) -> tuple[Any, memoryview]:
    """A transfer's first message: ``(header, its payload)``; the header's ``payload_bytes``
    is 0 when the message is whole on its own.

    Raises:
        CodecError: the message is malformed, or carries more payload than it announces.
    """
    header, payload = split_payload(first, message_type)
    if header.payload_bytes and not 0 <= payload.nbytes <= header.payload_bytes:
        raise CodecError(f"{message_type.__name__}: payload_bytes = {header.payload_bytes}, but "
                         f"the first message alone carries {payload.nbytes} payload bytes")
    if header.HasField("payload_offset") and header.payload_offset != 0:
        raise CodecError(f"{message_type.__name__}: the first message of a transfer says "
                         f"payload_offset = {header.payload_offset}; its payload starts at 0 "
                         f"(a message out of order)")
    return header, payload


def later_part(raw: bytes, message_type: type, number: int, received: int) -> memoryview:
    """The payload of a later message of a transfer (a view of ``raw``), checked to start
    where the bytes received so far end.

    Args:
        raw: the message.
        message_type: its protobuf type.
        number: its place in the transfer (the first message is 1), for messages.
        received: payload bytes received before it.

    Raises:
        CodecError: the message is malformed, has header fields, has no
            ``payload_offset``, or starts anywhere but at ``received``.
    """
    header, payload = split_payload(raw, message_type)
    name = f"{message_type.__name__}: message {number} of a chunked transfer"
    if not header.HasField("payload_offset"):
        raise CodecError(f"{name} has no payload_offset (field 13; a client older than the "
                         f"field: every message after the first must say where it starts)")
    offset = header.payload_offset
    header.ClearField("payload_offset")
    if header.ByteSize():
        raise CodecError(f"{name} may carry only payload (field 15) and payload_offset")
    if offset != received:
        what = ("repeats or overlaps bytes already received (a duplicated or reordered "
                "message)" if offset < received else
                f"leaves bytes {received}-{offset - 1} missing (a lost or reordered message)")
        raise CodecError(f"{name} says payload_offset = {offset}, but {received} payload bytes "
                         f"came before it: it {what}")
    return payload


def payload_parts(messages: list[bytes], message_type: type) -> tuple[Any, list[memoryview]]:
    """A whole received transfer: its header and its payload's parts (views of ``messages``).

    Raises:
        CodecError: no message, a malformed one, or parts that do not add up to ``payload_bytes``.
    """
    if not messages:
        raise CodecError(f"no {message_type.__name__} message")
    header, payload = first_part(messages[0], message_type)
    if not header.payload_bytes:
        if len(messages) > 1:
            raise CodecError(f"{message_type.__name__}: a second message after a whole one "
                             f"(payload_bytes unset)")
        return header, [payload]
    parts = [payload]
    received = payload.nbytes
    for number, raw in enumerate(messages[1:], start=2):
        parts.append(later_part(raw, message_type, number, received))
        received += parts[-1].nbytes
    if received != header.payload_bytes:
        raise CodecError(f"{message_type.__name__}: {received} payload bytes arrived, "
                         f"payload_bytes = {header.payload_bytes} were announced")
    return header, parts


def scatter(parts: list[memoryview], destinations: list[memoryview]) -> None:
    """Copy the concatenation of ``parts`` into the concatenation of ``destinations``
    (writable byte buffers of the same total size)."""
    sources = iter(parts)
    source, offset = memoryview(b""), 0
    for destination in destinations:
        target = np.frombuffer(destination, dtype=np.uint8)
        filled = 0
        while filled < target.size:
            if offset == source.nbytes:
                source, offset = next(sources), 0
                continue
            take = min(target.size - filled, source.nbytes - offset)
            target[filled:filled + take] = np.frombuffer(source, dtype=np.uint8, count=take,
                                                         offset=offset)
            filled += take
            offset += take


class Reassembly:
    """Rebuilds a chunked transfer's one-message form from its messages as they arrive.

    Args:
        first: the transfer's first message.
        message_type: the messages' protobuf type (with ``payload_bytes``).

    Attributes:
        nbytes: size of the one-message form (known from the first message).
        chunked: False when ``first`` is a whole message on its own
            (``payload_bytes`` unset); then :meth:`message` is ``first``.

    Raises:
        CodecError: ``first`` is malformed, or carries more payload than it announces.
    """

    def __init__(self, first: bytes, message_type: type) -> None:
        header, payload = first_part(first, message_type)
        self._type = message_type
        self.chunked = header.payload_bytes != 0
        self.nbytes = len(first)
        self._first = None if self.chunked else first
        if not self.chunked:
            return
        self._total = header.payload_bytes
        self._prefix = header.SerializeToString() + _PAYLOAD_TAG + varint(self._total)
        self.nbytes = len(self._prefix) + self._total
        self._buffer: np.ndarray | None = None
        self._filled = 0
        self._part = payload
        self._messages = 1

    def allocate(self) -> None:
        """Allocate the buffer (:attr:`nbytes`) and copy the first message's payload into it."""
        if not self.chunked or self._buffer is not None:
            return
        self._buffer = np.empty(self.nbytes, dtype=np.uint8)
        prefix = len(self._prefix)
        self._buffer[:prefix] = np.frombuffer(self._prefix, dtype=np.uint8)
        self._filled = prefix
        self._copy(self._part)
        self._part = memoryview(b"")

    def add(self, raw: bytes) -> None:
        """Copy a later message's payload into place (allocating first if needed).

        Raises:
            CodecError: the message has header fields, the transfer was whole,
                the message does not start where the payload received so far
                ends (see the module docstring), or the payload would exceed
                ``payload_bytes``.
        """
        if not self.chunked:
            raise CodecError(f"{self._type.__name__}: a second message after a whole one "
                             f"(payload_bytes unset)")
        self._messages += 1
        payload = later_part(raw, self._type, self._messages, self.received)
        self.allocate()
        self._copy(payload)

    def _copy(self, payload: memoryview) -> None:
        assert self._buffer is not None
        end = self._filled + payload.nbytes
        if end > self.nbytes:
            raise CodecError(f"{self._type.__name__}: more payload than the "
                             f"payload_bytes = {self._total} announced")
        self._buffer[self._filled:end] = np.frombuffer(payload, dtype=np.uint8)
        self._filled = end

    @property
    def complete(self) -> bool:
        """Whether every payload byte arrived."""
        return self._first is not None or self.received == self._total

    def release(self) -> None:
        """Drop the buffer (a refused transfer's memory goes now, not with its last reference)."""
        self._buffer = None
        self._part = memoryview(b"")
        self._filled = 0

    @property
    def received(self) -> int:
        """Payload bytes received so far (whole message: its size)."""
        if not self.chunked:
            return self.nbytes
        return self._filled - len(self._prefix) if self._buffer is not None else self._part.nbytes

    def message(self) -> memoryview | bytes:
        """The one-message form (a view of the buffer), once every payload byte arrived.

        Raises:
            CodecError: the transfer ended early.
        """
        if self._first is not None:
            return self._first
        self.allocate()
        if self._filled != self.nbytes:
            raise CodecError(f"{self._type.__name__}: the transfer ended after "
                             f"{self.received} of payload_bytes = {self._total}")
        assert self._buffer is not None
        return memoryview(self._buffer)
