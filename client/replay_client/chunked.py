"""Calls whose request or answer may exceed the message limit: sent or received in chunks.

A server reads at most one message of ``max_message_mb`` (a few MiB) per call
before its handler runs, so large inserts, samples, publishes and fetches
travel as several messages (:mod:`replay_proto.chunks`; ``replay.proto``,
"Chunked transfers"):

* :func:`insert` and :func:`publish` send one message when the request fits
  it, else the ``*Chunks`` RPC, built from the tensors' buffers directly (one
  copy, as one message would take); an insert of a few rows goes on the
  client's call stream (:mod:`replay_client.call_stream`) when it has one.
* :class:`LargeAnswers` samples with the unary ``Sample`` and fetches with
  the unary ``Fetch``; a client on the server's host samples through its
  sample call stream's shared-memory region instead (the batch is gathered
  there by the server and copied out by the client: no bytes through gRPC).
  An answer the server says is over the message limit
  (it refuses before drawing or encoding anything) is asked again with
  ``SampleChunks`` or ``FetchChunks``, and so is every later batch of that
  table at least as large, or fetch of that variable. (The unary calls are
  kept for what fits: a server-streaming call costs about 0.4 ms more here.)

Retries and errors are the connection's (:meth:`~replay_client.connection.Connection.unary`).
Thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from google.protobuf.message import DecodeError

from replay_client.call_fallback import StreamFallback, unary_after
from replay_client.call_stream import REGION_MAX_BYTES, CallStream
from replay_client.connection import CLIENT_TIMEOUT, Connection
from replay_feed.shared_ring import SharedMemoryError, SharedRing
from replay_client.errors import InternalError, MessageTooLargeError
from replay_proto import messages, variable_codec
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES
from replay_proto.batch import SampleBatch
from replay_proto.chunks import chunk_bytes, frame_chunks
from replay_proto.codec import CodecError, frame, frame_parts
from replay_proto.sample_codec import SampleDecoder, decode_sample, split_sample
from replay_proto.v1 import replay_pb2 as pb


def insert(connection: Connection, table: str, columns: dict[str, torch.Tensor],
           priorities: torch.Tensor | None, stream: CallStream | None = None) -> torch.Tensor:
    """Insert rows; returns their ids. A small insert goes on ``stream`` (the client's call
    stream for inserts) when the server takes it there; a large one through the stream's
    shared-memory region when the server is on this host and offers one (up to
    :data:`~replay_client.call_stream.REGION_MAX_BYTES`); else one message, or
    ``InsertChunks``. Not retried (except when the server ran nothing of it, see the
    connection and :mod:`replay_client.call_stream`)."""
    header, buffers = messages.insert_parts(table, columns, priorities)
    chunk = chunk_bytes(connection.max_message_bytes)
    size = sum(memoryview(b).nbytes for b in buffers) + header.ByteSize()
    if stream is not None and size < STREAM_MESSAGE_BYTES:
        request = frame(header, buffers)
        try:
            return messages.insert_ids(stream.send(request).insert)
        except StreamFallback as fallback:
            return unary_after(fallback, lambda: _plain_insert(connection, header, buffers,
                                                               size, chunk))
    if stream is not None and size <= REGION_MAX_BYTES:
        parts = frame_parts(header, buffers)
        try:
            answer = stream.send_in_region(sum(memoryview(p).nbytes for p in parts), parts)
            return messages.insert_ids(answer.insert)
        except StreamFallback as fallback:
            return unary_after(fallback, lambda: _plain_insert(connection, header, buffers,
                                                               size, chunk))
    return _plain_insert(connection, header, buffers, size, chunk)


def _plain_insert(connection: Connection, header: Any, buffers: list[memoryview], size: int,
                  chunk: int) -> torch.Tensor:
    """An insert as one ``Insert`` message, or as ``InsertChunks`` when it is larger."""
    if size < chunk:
        raw = connection.unary("Insert", frame(header, buffers), retry=False)
    else:
        parts = _chunks(lambda: frame_chunks(header, buffers, chunk))
        raw = connection.unary("InsertChunks", parts, retry=False, kind="stream_unary")
    return messages.decode_insert_response(raw)


def publish(connection: Connection, name: str, tensors: dict[str, torch.Tensor]) -> bytes:
    """Publish a variable (one message, or ``PublishChunks``); the raw PublishResponse."""
    header, buffers = variable_codec.publish_parts(name, tensors)
    chunk = chunk_bytes(connection.max_message_bytes)
    if sum(memoryview(b).nbytes for b in buffers) + header.ByteSize() < chunk:
        return connection.unary("Publish", frame(header, buffers), retry=False)
    parts = _chunks(lambda: frame_chunks(header, buffers, chunk))
    return connection.unary("PublishChunks", parts, retry=False, kind="stream_unary")


class LargeAnswers:
    """Samples and fetches: the unary call, or the ``*Chunks`` one once the server said the
    answer is over the message limit (it refuses before drawing or encoding anything);
    samples on the server's host through a call stream's region when there is one.

    Remembers, per table, the smallest batch size that was too large, and the
    variables that were, so later calls go straight to chunks.

    Args:
        connection: the server's connection.
        stream: this process's call stream for samples (``None``: plain calls only).
    """

    def __init__(self, connection: Connection,
                 stream: Callable[[], CallStream] | None = None) -> None:
        self.connection = connection
        self._stream = stream
        self._chunked_from: dict[str, int] = {}  # table -> smallest batch size too large
        self._large_variables: set[str] = set()

    def sample(self, table: str, batch_size: int, request: bytes,
               timeout: Any = CLIENT_TIMEOUT) -> SampleBatch:
        """The batch ``request`` (an encoded SampleRequest for ``batch_size`` rows) asks for:
        through the sample stream's region (with the client's own timeout only), else as
        below."""
        if self._stream is not None and timeout is CLIENT_TIMEOUT:
            try:
                return self._stream().sample_in_region(request, _owned_batch)
            except StreamFallback as fallback:
                return unary_after(fallback, lambda: self._plain_sample(
                    table, batch_size, request, timeout))
        return self._plain_sample(table, batch_size, request, timeout)

    def _plain_sample(self, table: str, batch_size: int, request: bytes,
                      timeout: Any) -> SampleBatch:
        """The batch through ``Sample``, or ``SampleChunks`` when it is over the message limit."""
        if batch_size < self._chunked_from.get(table, batch_size + 1):
            try:
                return decode_sample(self.connection.unary("Sample", request, retry=True,
                                                           timeout=timeout))
            except MessageTooLargeError:  # refused before anything was drawn
                self._chunked_from[table] = min(batch_size,
                                                self._chunked_from.get(table, batch_size))
        answers = self.connection.unary("SampleChunks", request, retry=True, timeout=timeout,
                                        kind="unary_stream")
        decoder = SampleDecoder()
        batches: list[SampleBatch] = []
        try:
            for answer in answers:
                batches += decoder.add(*split_sample(answer))
        except CodecError as exc:
            raise InternalError(f"the server's SampleChunks answer: {exc}") from None
        if len(batches) != 1:
            raise InternalError(f"SampleChunks answered {len(batches)} batches, not one")
        return batches[0]

    def fetch(self, name: str, request: bytes, timeout: Any) -> variable_codec.FetchAnswer:
        """The answer to ``request`` (an encoded FetchRequest for variable ``name``)."""
        if name not in self._large_variables:
            try:
                return variable_codec.decode_fetch(self.connection.unary(
                    "Fetch", request, retry=True, timeout=timeout))
            except MessageTooLargeError:  # refused before anything was encoded
                self._large_variables.add(name)
        answers = self.connection.unary("FetchChunks", request, retry=True, timeout=timeout,
                                        kind="unary_stream")
        try:
            return variable_codec.decode_fetch_chunks(answers)
        except CodecError as exc:
            raise InternalError(f"the server's FetchChunks answer: {exc}") from None


def _owned_batch(raw: bytes, region: SharedRing) -> SampleBatch:
    """The batch a ``sampled_in_region`` answer (``raw``: its SampleResponse) places in
    ``region``, copied out of it (the region is the stream's next request's).

    Raises:
        InternalError: the answer does not describe tensors inside the region.
    """
    try:
        header = pb.SampleResponse.FromString(raw)
        batch = SampleDecoder(ring_view=region.view).add(header, memoryview(b""))[0]
    except (CodecError, SharedMemoryError, DecodeError) as exc:
        raise InternalError(f"the server's sample_in_region answer: {exc}") from None
    return batch.with_tensors([tensor.clone() for tensor in batch.tensors()])


def _chunks(build: Any) -> list[bytes]:
    try:
        return build()
    except CodecError as exc:  # a header alone over the message limit
        raise MessageTooLargeError(str(exc)) from None
