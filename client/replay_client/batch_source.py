"""Batch sources: how a learner reads a ``SampleStream``'s batches, one kind per transport.

A stream's batches arrive as gRPC messages (decoded into the feed's staging
by :class:`~replay_proto.sample_codec.SampleDecoder`) until the learner
accepts another transport. When a call opens, every registered
:class:`SourceKind` (:mod:`replay_client.sources`) may ask for its transport
in the first message (:meth:`SourceKind.ask`); the server's matching *sink*
(``replay_server.service.batch_sink``) offers it with the first batch, and
the kind whose offer came makes a :class:`BatchSource` (or refuses, saying
why). From then on the source reads the messages that locate batches in its
transport; the link (:class:`~replay_client.stream.SampleLink`) keeps the
credits, updates and reconnects. ``docs/learner.md`` shows a new pair.

Thread-safety: a source is used by its link's thread (the feed's producer);
:meth:`BatchSource.close` is called there too, once its call is over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from replay_feed.delivery import Delivery
from replay_proto.batch import SampleBatch
from replay_proto.v1 import replay_pb2 as pb


@dataclass(frozen=True, slots=True)
class SourceContext:
    """What a source kind may use when the server's offer arrives.

    Attributes:
        window: the learner's whole window (batches it may hold ahead).
        delivery: the stream's device and pinning (``None``: views for a merge).
        refusal: non-empty: refuse any offer, for this reason (small batches are grouped
            over gRPC).
        given_back: ``given_back(k, fn)``: call ``fn`` on the learner's thread when it gives
            the call's batch ``k`` back (before that credit is sent); ``None`` where the
            stream cannot say (a merge of shards).
    """

    window: int
    delivery: Delivery | None
    refusal: str = ""
    given_back: Callable[[int, Callable[[], None]], None] | None = None


@dataclass(frozen=True, slots=True)
class Opened:
    """A kind's answer to its offer: the source (``None``: refused), the message answering
    the server (sent before the next grant), and a note for ``stream.stats.notes``."""

    source: BatchSource | None
    answer: pb.SampleStreamRequest
    note: str


class BatchSource(Protocol):
    """One call's reader of an accepted transport (see the module docstring)."""

    name: str
    """The transport's name (``stream.transport``)."""

    window_grows: bool
    """Whether the learner's window may widen while this source is read (a ring's slots are
    fixed)."""

    def batches(self, header: pb.SampleResponse, payload: memoryview) -> list[SampleBatch] | None:
        """The batches message ``header`` locates in this transport, or ``None`` when it is a
        gRPC message like any other (the link's decoder reads it)."""

    def close(self) -> None:
        """Release what the source holds (a mapped ring); idempotent."""


class SourceKind(Protocol):
    """A transport's learner side in the registry (:mod:`replay_client.sources`)."""

    name: str
    title: str
    """The transport in words, for a note when the server offered none
    ("the server offered no shared-memory ring")."""

    def ask(self, opening: pb.SampleStreamRequest, local: bool) -> bool:
        """Ask for this transport in a call's first message, if wanted; whether asked.
        ``local``: the learner allows same-host transports (``shared_memory`` option,
        ``REPLAY_SHARED_MEMORY``, batches not grouped).

        A kind may also define ``wanted(delivery, lends) -> bool``: the link asks it only
        for the streams it serves (``delivery``: the stream's device and pinning;
        ``lends``: the stream can say when each batch is given back, as
        :attr:`SourceContext.given_back`). CUDA IPC does."""

    def open(self, header: pb.SampleResponse, context: SourceContext) -> Opened | None:
        """Take (or refuse) this transport's offer in the first batch's ``header``; ``None``
        when the header holds no offer of this kind."""


def transport_answer(name: str, accepted: bool, reason: str = "") -> pb.SampleStreamRequest:
    """The answer to transport ``name``'s offer (``SampleResponse.transport_offer``), for a
    kind's :meth:`~SourceKind.open` (the shared-memory ring has its own answer message)."""
    return pb.SampleStreamRequest(transport_answer=pb.TransportAnswer(
        name=name, accepted=accepted, reason=reason))


def transport_offer(name: str, header: pb.SampleResponse) -> pb.TransportOffer | None:
    """Transport ``name``'s offer in a first batch's ``header``, if it holds one."""
    if header.HasField("transport_offer") and header.transport_offer.name == name:
        return header.transport_offer
    return None
