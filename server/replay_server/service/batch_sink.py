"""Batch sinks: how a ``SampleStream``'s batches leave the server, one kind per transport.

A stream's batches always start as gRPC messages (:class:`MessageSink`: each
group of batches drawn at once, encoded in chunks of whole rows). When the
stream opens, every registered :class:`SinkKind` (:mod:`replay_server.service.sinks`)
may take the learner's first message as a request for its transport and make
a sink for it; the first that does offers itself with the first batch
(:meth:`BatchSink.offer`), and once the learner accepts (:meth:`BatchSink.answered`)
the stream's later batches go through it, its messages carrying only what
locates them. The call (:class:`~replay_server.service.sample_stream.SampleStreamCall`)
keeps the credits, the draws and the memory; a sink only says how many batches
it takes at once, what a group holds while it is sent, and how a drawn group
becomes messages. The client's side is the matching *source*
(``replay_client.batch_source``); ``docs/learner.md`` shows a new pair.

Thread-safety: a sink's :meth:`~BatchSink.send` and :meth:`~BatchSink.offer`
run on the engine's threads, one draw of a stream at a time; the rest on the
event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from replay_proto.batch import SampleBatch
from replay_proto.sample_codec import HEADROOM, STREAM_CHUNK_BYTES, encode_sample
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import MAX_BATCH_SIZE
from replay_server.service.budget import MemoryBudget, Reservation

if TYPE_CHECKING:
    from replay_server.engine import Table
    from replay_server.service.settings import ServerSettings


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """What the server allows a stream: message size, whether it offers shared memory, the
    largest batch, and the budgets its batches and rings are reserved from."""

    max_message_bytes: int
    shared_memory: bool
    max_batch_bytes: int
    budget: MemoryBudget
    shared_memory_budget: MemoryBudget
    closing_wait_s: float
    """How long a stream that had its ``num_batches`` waits for a learner that said it
    leaves with ``closing`` (``server.response_timeout_s``)."""


class Draw(Protocol):
    """The call's draw of one group: ``draw(count, out)`` draws ``count`` batches at once
    (``out``: columns to gather one batch into, as a ring slot's) under the stream's lease
    and waiting rules; returns the group and how many batches it holds (a group the rate
    limiter holds back is drawn as one batch)."""

    def __call__(self, count: int,
                 out: dict[str, torch.Tensor] | None = None) -> tuple[SampleBatch, int]: ...


@dataclass(frozen=True, slots=True)
class SinkContext:
    """What a sink kind may use when a stream opens.

    Attributes:
        first: the learner's first message (what it asked for).
        limits: the server's stream limits and budgets.
        owner: the call's reservation; a sink's own memory is a part of it, released
            with it however the call ends.
        window: the learner's whole window (batches it may hold ahead).
        log: ``log(topic, level, what)``: a line about this stream's client, rate-limited.
        table: the stream's table (a device table's sinks may keep batches on its device).
    """

    first: pb.SampleStreamRequest
    limits: StreamLimits
    owner: Reservation
    window: int
    log: Callable[[str, int, str], None]
    table: Table | None = None


class BatchSink(Protocol):
    """One stream's way of sending batches (see the module docstring)."""

    name: str
    """The transport's name (``stream.transport``, the ``transport`` label of metrics)."""

    def group(self, wanted: int, batch_size: int, batch_bytes: int) -> int:
        """Batches to draw at once, at most ``wanted`` (credit and grouping allow it)."""

    def held_bytes(self, count: int, batch_bytes: int, extras: int) -> int:
        """Bytes a group of ``count`` batches holds until sent (``extras``: its ids, weights
        and probabilities)."""

    def send(self, draw: Draw, index: int, count: int) -> tuple[list[bytes], int, SampleBatch]:
        """Draw the group of batches ``index ...`` (at most ``count``) and make its messages;
        returns them, the batches they hold and the group as drawn."""

    def offer(self, batch: SampleBatch, batch_size: int) -> tuple[bytes, str]:
        """Make the transport for a stream whose first group is ``batch``: the message part
        that offers it (merged into the first chunk), or ``b""`` and why not (a note the
        first batch carries to the learner)."""

    def answered(self, message: pb.SampleStreamRequest) -> bool | None:
        """The learner's answer to :meth:`offer` in ``message``: accepted, refused (the sink
        closed itself), or ``None`` when the message holds no answer for it."""

    def close(self) -> None:
        """Release what the sink holds (idempotent); any thread."""


class SinkKind(Protocol):
    """A transport's server side in the registry (:mod:`replay_server.service.sinks`)."""

    name: str

    def open(self, context: SinkContext) -> tuple[BatchSink | None, str]:
        """A sink for a stream whose learner asked for this transport, or ``None`` and why
        not (``""``: it was not asked for)."""

    def prepare(self, settings: ServerSettings) -> None:
        """Once at the server's start, before it serves: clean up what a server that is gone
        left behind."""


class MessageSink:
    """gRPC messages, every stream's transport until another is accepted: each group of
    batches drawn at once, in chunks of whole rows of at most 4 MiB (or the message limit
    less its header); the group holds the batches and their encoded chunks until sent."""

    name = "grpc"

    def __init__(self, max_message_bytes: int) -> None:
        self._chunk_bytes = max(1, min(STREAM_CHUNK_BYTES, max_message_bytes - HEADROOM))

    def group(self, wanted: int, batch_size: int, batch_bytes: int) -> int:
        count = wanted
        if batch_bytes:
            count = max(1, min(count, STREAM_CHUNK_BYTES // batch_bytes))
        if count > 1 and batch_size * count > MAX_BATCH_SIZE:
            count = 1
        return count

    def held_bytes(self, count: int, batch_bytes: int, extras: int) -> int:
        return 2 * count * batch_bytes + extras

    def send(self, draw: Draw, index: int, count: int) -> tuple[list[bytes], int, SampleBatch]:
        batch, count = draw(count)
        return encode_sample(batch, index, self._chunk_bytes, batch_count=count), count, batch

    def offer(self, batch: SampleBatch, batch_size: int) -> tuple[bytes, str]:
        return b"", ""

    def answered(self, message: pb.SampleStreamRequest) -> bool | None:
        return None

    def close(self) -> None:
        pass


def transport_offer(name: str, params: bytes) -> bytes:
    """The message part offering transport ``name`` (``params`` in its own terms), for a
    sink's :meth:`~BatchSink.offer` (the shared-memory ring has its own offer message)."""
    return pb.SampleResponse(
        transport_offer=pb.TransportOffer(name=name, params=params)).SerializeToString()


def transport_answer(name: str, message: pb.SampleStreamRequest) -> pb.TransportAnswer | None:
    """The learner's answer to transport ``name``'s offer in ``message``, if it holds one."""
    if message.HasField("transport_answer") and message.transport_answer.name == name:
        return message.transport_answer
    return None
