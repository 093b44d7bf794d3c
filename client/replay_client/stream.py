"""The learner's network link: SampleStream's credits and updates, its batches from a source.

:class:`SampleLink` is the :class:`~replay_feed.link.Link` behind
``ReplayClient.stream`` (and behind each shard of a sharded stream). One
call is one bidirectional ``SampleStream``: its first message names the
table and grants the credits the learner has room for; the call's request
iterator (run by gRPC on its own thread) then forwards every grant of the
learner's :class:`~replay_feed.credits.CreditFlow` (credits, window growth,
priority updates, which the server applies before those credits count).
Each message received becomes batches in the feed's staging buffers
(payload chunks decoded in place by the wire package's one
:class:`~replay_proto.sample_codec.SampleDecoder`) or, for a sharded
stream's merge, views of the message itself; once the learner accepted
another transport's offer, the messages that locate batches there are its
*source*'s to read (the same-host shared-memory ring: views of the ring,
nothing to copy; :mod:`replay_client.batch_source`, :mod:`replay_client.sources`).

Queue tables: every call names a lease prefix of its own; when the
server's first batch says the call is leased (``SampleResponse.leased``),
each message also reports the call's batches the learner finished
(``finished``: the flow counts them, see :class:`~replay_feed.credits.CreditFlow`),
and closing the stream waits (at most :data:`CLOSE_S`) for the
server to end the call after the last report, so that it counts before
the server gives back what was not finished. Batches of a lost call are
the lost call's: the server gave back those not finished when it lost it.

Closing: the call's last message says the learner leaves (:data:`CLOSING`,
after its last updates); a stream that carried updates, or a leased one,
waits for the server to end the call before letting go, so that nothing it
sent is dropped unread. A stream of ``num_batches`` says in its first
message that it leaves so (``stays_until_closing``): the server keeps the
call open after the last batch, and the link stops reading it there, so the
updates of the batches the learner takes after that still reach the server
(they were dropped when the server ended the call with its last batch, up
to a window of batches before the learner had them).

Restart policy: when the connection is lost (UNAVAILABLE: server restarted,
draining or unreachable), or the server refused the call as overloaded
before sending a batch (its stream slots or memory in use; nothing ran), the
call raises :class:`~replay_feed.link.LinkLost`
and the stream's :class:`~replay_feed.link.LinkRunner` reconnects with
backoff for up to the connection's ``max_retry_s`` and goes on with new
batches (sampling has no position to resume from; the batch in flight is
dropped); the learner's loop does not notice beyond
``stream.stats.reconnects``. With ``reconnect=False``, or when the server
stays away longer, the learner gets :class:`~replay_client.errors.UnavailableError`
after the batches already received. Every other server error ends the
stream with its typed exception.

Waiting for data (``wait``, the default): each request asks the server to
hold a batch while the table cannot serve it, so a learner that starts
before its actors, or reconnects to a restarted server whose tables are
empty, waits instead of failing with ``EmptyTableError``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from replay_client import grouping, sources
from replay_client.batch_source import BatchSource, SourceContext, SourceKind
from replay_client.connection import Connection
from replay_client.errors import OverloadedError, UnavailableError
from replay_feed.core import FeedStats
from replay_feed.credits import CreditFlow, Grant, PriorityUpdate
from replay_feed.delivery import Delivery
from replay_feed.link import LinkLost
from replay_feed.options import RECONNECT_S
from replay_proto import messages
from replay_proto.batch import SampleBatch
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, request_bytes_metadata
from replay_proto.codec import spec_nbytes
from replay_proto.sample_codec import Allocate, SampleDecoder, split_sample
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.stream")

FLUSH_S = 2.0
"""How long closing a stream waits for its last messages to be handed to gRPC before cancelling."""

CLOSE_S = 2.0
"""How long closing a stream that sent priority updates, or a leased one (a queue table's),
waits after its last message for the server to end the call. A message gRPC sent is not yet
read by the server: cancelling at once may drop it, and with it the learner's last updates (or
its acknowledgements). On the learner's last message (:data:`CLOSING`) the server draws
nothing more and ends the call, having read every message: usually one round trip (a server
older than that message first sends the batches already credited)."""

CLOSING = pb.SampleStreamRequest(closing=True).SerializeToString()
"""A stream's last message: the learner leaves; the server draws nothing more and ends the
call once it has read (and applied) everything before."""

MAX_UPDATE_IDS = (STREAM_MESSAGE_BYTES - 1024) // 16
"""Ids one credit message carries at most (int64 id + float64 priority each); a larger
update travels as several messages, the credits on the last."""


class StagingTarget:
    """Where a link puts what it receives: the feed's staging and the stream's stats.

    Args:
        allocate: the buffers batch ``k`` is decoded into (``None``: views, no copy).
        copy: writes decoded rows into those buffers.
        stats: the stream's stats (transport notes).
        delivery: the stream's device and pinning (a source may pin its memory in place).
        given_back: ``given_back(k, fn)`` calls ``fn`` on the learner's thread when it gives
            the stream's batch ``k`` back (``None``: the stream cannot say, e.g. a merge of
            shards; transports that lend device memory are not asked for).
    """

    def __init__(self, allocate: Allocate | None, copy: Callable[..., None] | None,
                 stats: FeedStats, delivery: Delivery | None,
                 given_back: Callable[[int, Callable[[], None]], None] | None = None) -> None:
        self.allocate = allocate
        self.copy = copy
        self.stats = stats
        self.delivery = delivery
        self.given_back = given_back


class _Outgoing:
    """One call's request iterator: the first message, then grants and answers to offers.

    ``start``: the stream's index of the call's first batch. Once the server said
    the call is leased (``leased``), each grant also reports the call's batches
    the learner finished since the previous message (the flow counts the
    stream's; batches of an earlier call are not this call's to report).
    """

    def __init__(self, link: SampleLink, flow: CreditFlow, first: list[bytes],
                 start: int, updated: bool) -> None:
        self.link = link
        self.flow = flow
        self.first = first
        self.start = start
        self.done = False
        self.leased = False
        self.updated = updated  # the call carried a priority update
        self.reported = 0  # batches of this call reported finished
        self.finished = threading.Event()
        self.ended = threading.Event()  # the call is over (set by gRPC's done callback)
        self.answers: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def newly_finished(self) -> int:
        """Batches of this call finished since the last report (0 unless leased)."""
        if not self.leased:
            return 0
        done = max(0, self.flow.finished - self.start)
        count, self.reported = done - self.reported, max(done, self.reported)
        return max(0, count)

    def requests(self) -> Iterator[bytes]:
        try:
            yield from self.first
            while True:
                grant = self.flow.next_grant()
                if grant is None:  # the stream is stopping: say so after the last updates,
                    yield CLOSING  # then half-close (the server ends the call, all read)
                    return
                if self.done:
                    self.flow.unsent(grant)
                    return
                while True:
                    try:
                        yield self.answers.get_nowait()
                    except queue.Empty:
                        break
                if grant:
                    self.updated = self.updated or bool(grant.updates)
                    yield from self.link.encode_grant(grant, self.newly_finished())
        finally:
            self.finished.set()

    def end(self) -> None:
        """gRPC's done callback: the call is over, nothing more of it will be sent."""
        self.ended.set()
        self.finished.set()

    def send(self, message: pb.SampleStreamRequest) -> None:
        """A message of the client's own (an answer, a new grouping), before the next grant."""
        self.answers.put(message.SerializeToString())
        self.flow.wake()


class SampleLink:
    """A server's SampleStream as a :class:`~replay_feed.link.Link` (see the module docstring).

    Args:
        connection: the server (address, token, retry window).
        table: table name.
        batch_size: rows (or slices) per batch.
        target: where batches go (the feed's staging, or views).
        batches_per_message: let the server draw and send that many batches at
            once (gRPC only; a throughput trade-off for small rows); ``None``:
            chosen when the first batch's size is known (:mod:`replay_client.grouping`),
            within ``prefetch`` if the learner gave one, else widening the window
            to hold two groups.
        prefetch: the window the learner asked for (``None``: the stream's own).
        shared_memory: ask for same-host transports, the shared-memory ring (falls back
            to gRPC when the server cannot or the ring cannot be mapped;
            ``REPLAY_SHARED_MEMORY=0`` in the environment turns it off).
        wait: the server waits while the table cannot serve a batch (also after a reconnect).
        wait_timeout: seconds a batch may wait (``None``: no limit).
        most_per_message: batches per message at most when chosen (a sharded stream's
            shard, whose batches are chunks of the learner's: more).
    """

    def __init__(self, connection: Connection, table: str, batch_size: int,
                 target: StagingTarget, *, batches_per_message: int | None = 1,
                 prefetch: int | None = None, shared_memory: bool = True, wait: bool = True,
                 wait_timeout: float | None = None,
                 most_per_message: int = grouping.MAX_GROUP) -> None:
        self.connection = connection
        self.table = table
        self.batch_size = batch_size
        self.target = target
        self.batches_per_message = batches_per_message or 1
        self._grouping_chosen = batches_per_message is not None
        self._prefetch = prefetch
        self._most_per_message = most_per_message
        self.shared_memory = shared_memory and os.environ.get("REPLAY_SHARED_MEMORY", "1") != "0"
        self.wait = wait
        self.wait_timeout = wait_timeout
        self._call: Any = None
        self._outgoing: _Outgoing | None = None
        self._source: BatchSource | None = None  # the accepted transport's reader
        self._asked: list[SourceKind] = []  # the kinds the current call asked for
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def transport(self) -> str:
        source = self._source
        return "grpc" if source is None else source.name

    @property
    def window_grows(self) -> bool:
        """Whether the learner's window may widen now (not while a ring's fixed slots are read)."""
        source = self._source
        return source is None or source.window_grows

    @property
    def leased(self) -> bool:
        """Whether the current call's batches are leased (a queue table's, as its first
        batch said)."""
        outgoing = self._outgoing
        return outgoing is not None and outgoing.leased

    # ------------------------------------------------------------ one call

    def call(self, flow: CreditFlow, credits: int, updates: list[PriorityUpdate],
             remaining: int, first: int) -> Iterator[SampleBatch]:
        outgoing = _Outgoing(self, flow, self._opening(flow, credits, updates, remaining, first),
                             first, updated=bool(updates))
        connection = self.connection
        with self._lock:
            if self._stopped.is_set():
                return
            call = connection.method("SampleStream", kind="stream_stream")(
                outgoing.requests(),
                metadata=connection.metadata + request_bytes_metadata(STREAM_MESSAGE_BYTES))
            self._call, self._outgoing = call, outgoing
        call.add_done_callback(lambda _: outgoing.end())
        target = self.target
        views = target.allocate is None

        def staging(index: int, layout: Any) -> Sequence[torch.Tensor]:
            assert target.allocate is not None
            return target.allocate(first + index, layout)

        decoder = SampleDecoder(self.batch_size, allocate=None if views else staging,
                                copy=target.copy or _no_copy, views=views)
        opened = True
        received = 0
        last = False  # the call's last batch came: the call stays open for the learner
        try:
            for raw in call:
                header, payload = split_sample(raw)
                if opened:
                    opened = False
                    connection.answered = True
                    self._on_first(header, outgoing, flow)
                source = self._source
                batches = None if source is None else source.batches(header, payload)
                for batch in decoder.add(header, payload) if batches is None else batches:
                    received += 1
                    yield batch
                if remaining and received >= remaining:
                    # The server keeps the call open (stays_until_closing) to read the
                    # updates of the batches the learner has not taken yet, and its leaving.
                    last = True
                    return
        except grpc.RpcError as exc:
            if self._stopped.is_set():
                return
            error = connection.error(exc)
            if isinstance(error, UnavailableError):
                raise LinkLost(error, self._give_up(error)) from None
            if isinstance(error, OverloadedError) and opened:
                # Refused before it sent anything (the server's streams or memory were in
                # use, by calls it ends at their deadlines): opened again with backoff.
                raise LinkLost(error, lambda _window: error) from None
            raise error from None
        finally:
            if not last:
                outgoing.done = True
            flow.wake()

    def _opening(self, flow: CreditFlow, credits: int, updates: list[PriorityUpdate],
                 remaining: int, first: int) -> list[bytes]:
        """A call's first messages: the request, its credits, the updates still waiting, and
        the transports the registered source kinds ask for (the previous call's source let go)."""
        request = pb.SampleRequest(table=self.table, batch_size=self.batch_size,
                                   num_batches=remaining,
                                   batches_per_message=self.batches_per_message,
                                   wait_for_data=self.wait,
                                   wait_timeout_s=self.wait_timeout or 0.0)
        opening = pb.SampleStreamRequest(request=request, credits=credits, window=flow.window,
                                         lease=f"{uuid.uuid4().hex}-{first}",
                                         stays_until_closing=True)
        self._close_source()
        self._asked = [kind for kind in sources.SOURCES.values()
                       if self._wanted(kind) and kind.ask(opening, self.shared_memory)]
        return (self._first_with_updates(opening, updates) if updates
                else [opening.SerializeToString()])

    def _wanted(self, kind: SourceKind) -> bool:
        """Whether to offer ``kind`` to ask: a kind may say it serves only some streams
        (``wanted(delivery, lends)``, optional: CUDA IPC serves a stream that delivers to
        its device and can say when each batch is given back)."""
        wanted = getattr(kind, "wanted", None)
        target = self.target
        return wanted is None or bool(wanted(target.delivery, target.given_back is not None))

    def _first_with_updates(self, opening: pb.SampleStreamRequest,
                            updates: list[PriorityUpdate]) -> list[bytes]:
        """The call's first messages when updates wait (a call reopened after a lost one):
        the request with its credits and the first part of the updates, which the server
        applies before drawing; an update too large for one message sends its rest right
        after (credits 0), so batches of the first credits may be drawn before that rest."""
        parts = self.encode_grant(Grant(0, updates))
        first = pb.SampleStreamRequest.FromString(parts[0])
        first.MergeFrom(opening)
        return [first.SerializeToString(), *parts[1:]]

    def encode_grant(self, grant: Grant, finished: int = 0) -> list[bytes]:
        """``grant`` as credit messages: its updates (split to fit a message), the credits
        (and ``finished``: the call's batches the learner finished) on the last."""
        if not grant.updates:
            if not grant.credits and not finished:
                return []
            return [messages.encode_credit(grant.credits, finished=finished)]
        ids = np.concatenate([u.ids for u in grant.updates])
        priorities = np.concatenate([u.priorities for u in grant.updates])
        parts = []
        for start in range(0, max(1, ids.size), MAX_UPDATE_IDS):
            stop = start + MAX_UPDATE_IDS
            last = stop >= ids.size
            parts.append(messages.encode_credit(
                grant.credits if last else 0,
                messages.encode_update(self.table, ids[start:stop], priorities[start:stop]),
                finished=finished if last else 0))
        return parts

    def _give_up(self, error: BaseException) -> Callable[[float], BaseException]:
        connection = self.connection

        def give_up(window: float) -> BaseException:
            if not connection.answered:
                return error  # "no replay server at HOST:PORT (is it running?)"
            return UnavailableError(
                f"stream from {connection.address} lost and not back within {window:g} s "
                f"(how long a stream waits for its server: stream(..., reconnect_s=...), "
                f"default {RECONNECT_S:.0f} s or the client's max_retry_s if longer): {error}")

        return give_up

    def stop(self) -> None:
        """End the call: once the request iterator has sent what it holds (the updates the
        learner made last, and the batches it finished, when its credits stopped; at most
        :data:`FLUSH_S`), and, on a call that carried priority updates or a leased one, once
        the server ended it (having read them all, and given back the batches not finished;
        at most :data:`CLOSE_S`), cancel it."""
        with self._lock:
            self._stopped.set()
            call, outgoing = self._call, self._outgoing
        if call is None:
            return
        if outgoing is not None and outgoing.flow.stopping.is_set():
            flushed = outgoing.finished.wait(FLUSH_S)
            waits = outgoing.leased or outgoing.updated
            if waits and flushed:
                outgoing.ended.wait(CLOSE_S)
            if waits and not outgoing.ended.is_set():
                log.warning("stream of %r from %s cancelled before the server ended it: the "
                            "learner's last priority updates%s may not have reached it",
                            self.table, self.connection.address,
                            " and acknowledgements" if outgoing.leased else "")
        call.cancel()

    def close(self) -> None:
        """Release the source (after the runner ended)."""
        self._close_source()

    def after_last(self, flow: CreditFlow) -> None:
        """Nothing: the call stays open after its last batch (``stays_until_closing``), and
        its request iterator forwards the learner's updates until it leaves."""

    # ------------------------------------------------------------ the first batch

    def _choose_grouping(self, header: pb.SampleResponse, outgoing: _Outgoing,
                         flow: CreditFlow) -> bool:
        """Group small batches, now that the first one's size is known; whether grouped."""
        self._grouping_chosen = True
        specs = [*header.columns, header.ids, header.weights, header.probabilities]
        per_row = sum(spec_nbytes(spec) // max(1, spec.shape[0]) for spec in specs if spec.shape)
        chosen = grouping.choose(per_row * self.batch_size, self._prefetch,
                                 self._most_per_message)
        if chosen.batches_per_message <= 1:
            return False
        self.batches_per_message = chosen.batches_per_message
        outgoing.send(pb.SampleStreamRequest(batches_per_message=chosen.batches_per_message))
        if chosen.prefetch > flow.window:
            flow.grow(chosen.prefetch - flow.window)
        self.target.stats.notes.append(chosen.note)
        return True

    def _on_first(self, header: pb.SampleResponse, outgoing: _Outgoing, flow: CreditFlow) -> None:
        """The first batch: its lease, the grouping of small batches, and the offer of a
        transport the call asked for (taken, or refused with the reason)."""
        outgoing.leased = header.leased
        notes = self.target.stats.notes
        grouped = not self._grouping_chosen and self._choose_grouping(header, outgoing, flow)
        refusal = (f"small batches are grouped over gRPC (batches_per_message="
                   f"{self.batches_per_message})" if grouped else "")
        given_back = self.target.given_back
        start = outgoing.start
        context = SourceContext(
            flow.window, self.target.delivery, refusal,
            None if given_back is None else
            lambda index, hook: given_back(start + index, hook))
        for kind in self._asked:
            opened = kind.open(header, context)
            if opened is None:
                continue
            outgoing.send(opened.answer)
            notes.append(opened.note)
            self._source = opened.source
            return
        if header.transport_note:
            notes.append(f"gRPC: {header.transport_note}")
        elif self._asked:
            offered = " or ".join(kind.title for kind in self._asked)
            notes.append(f"gRPC: the server offered no {offered}")

    def _close_source(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()


def _no_copy(dest: torch.Tensor, start: int, src: torch.Tensor) -> None:  # pragma: no cover
    raise AssertionError("a views decoder copies nothing")
