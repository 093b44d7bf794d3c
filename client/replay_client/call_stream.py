"""Small calls on one persistent ``CallStream`` call, so a call that waits costs a round trip.

``update_priorities(..., wait=True)`` and ``insert`` of a few rows used to
be a unary call each (about 1.1 ms of the server's CPU and 0.6 ms of
Python gRPC on the project's machine, most of it setting up and tearing
down the call). :class:`CallStream` keeps one bidirectional call open: a
request is one message out, its answer one message back, matched by order
(the server answers in the order it was sent; ``replay.proto`` documents
the messages). A client keeps one for its updates and one for its inserts,
so an insert a rate limiter holds back never holds a learner's update.

A stream nothing was sent on for :data:`IDLE_CLOSE_S` is ended (the next
request opens a new one), so idle clients hold nothing on the server.

Bounds: at most 64 updates are unanswered at once; a sender beyond that waits
for a slot (within its timeout). Inserts may wait on the server (for their
rate limiter), so one is on the stream at a time and another thread's insert
meanwhile goes unary: an insert held for one table never holds one into
another. Each request waits at most the
connection's timeout (to within a quarter of it, at most a second) for its
answer, and tells the server it may wait that long; past it the call is
cancelled: the late request raises
:class:`~replay_client.errors.DeadlineExceededError`, the others in flight
go the unary way.

The call declares messages of at most
:data:`~replay_proto.call_metadata.STREAM_MESSAGE_BYTES` (64 KiB: about 5,000
ids, or 900 rows of 17 floats): the server reserves that much for it. A
larger request is not sent on the stream.

When a request cannot go this way (it is larger than that, the server is
too old to know the RPC, refused the stream for its cap on call streams,
the stream broke, or the server is draining), :meth:`CallStream.send`
raises :class:`StreamFallback` and the caller makes the unary call instead,
which has the client's retry policy. Never twice: the server reads a
request only once it answered the one before, so when the stream breaks
only the oldest unanswered request may have been applied. That one, if it
is not safe to repeat (an insert), raises
:class:`~replay_client.errors.UnavailableError` saying it may or may not have
been stored, exactly as a unary insert whose connection broke does; a
priority update (setting the same priorities again changes nothing) falls
back like the rest. A server that answered UNIMPLEMENTED is asked under the
next name (``UpdateStream``, which servers before ``CallStream`` serve for
updates) or not again; one that refused the stream is not asked again for
:data:`REFUSED_RETRY_S`. A request the server refused raises its own typed
error, exactly as the unary call would have.

Thread-safety: :meth:`send` may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc
import numpy as np

from replay_client.call_fallback import NOT_HANDLED, StreamFallback, call_error, drained
from replay_client.connection import Connection, never_sent
from replay_client.local_updates import LocalUpdates
from replay_feed.shared_ring import SharedMemoryError, SharedRing, host_id
from replay_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    ReplayError,
    UnavailableError,
)
from replay_proto import messages
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, request_bytes_metadata
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.call_stream")

T = TypeVar("T")

DEFAULT_WINDOW = 64
"""Requests one client may have unanswered on its stream."""

_HEADER_BYTES = 32
"""Room a CallStreamRequest adds around its request (sequence, timeout and field tags)."""

IDLE_CLOSE_S = 60.0
"""A stream nothing was sent on for this long is ended (with a client timeout: its watchdog
looks), so an actor that stopped inserting holds no stream slot and no reservation on the
server; the next request opens a new one."""

REFUSED_RETRY_S = 30.0
"""After the server refused a stream (its cap on call streams, or its memory), calls go unary
this long before a stream is tried again."""

UPDATES = ("CallStream", "UpdateStream")
"""The RPCs priority updates may use, newest first."""

INSERTS = ("CallStream",)
"""The RPCs inserts and samples may use."""

REGION_MIN_BYTES = 8 << 20
"""The smallest shared-memory region a client asks for (a power of two at least the insert)."""

SAMPLE_REGION_MIN_BYTES = 64 << 10
"""The smallest region a sample stream asks for (a power of two at least the batch, which
the server names): a client sampling small batches holds little of ``shared_memory_mb``."""

REGION_MAX_BYTES = 64 << 20
"""Inserts larger than this are sent chunked, and batches larger than this sampled with
plain calls, never through a region."""


class _Pending:
    """One request waiting for its answer."""

    __slots__ = ("deadline", "repeatable", "probe", "finished", "answer", "error")

    def __init__(self, deadline: float | None, repeatable: bool, probe: bool = False) -> None:
        self.deadline = deadline
        self.repeatable = repeatable  # applying it twice changes nothing (an update)
        self.probe = probe  # asks for a region: a server that ends the stream has none
        self.finished = False
        self.answer: pb.CallStreamResponse | None = None
        self.error: BaseException | None = None


class _Session:
    """One open CallStream call: its outgoing queue and its unanswered requests, in order."""

    def __init__(self, connection: Connection, method: str) -> None:
        self.outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.pending: deque[_Pending] = deque()
        self.sequence = 0
        self.closed = False
        self.ended = threading.Event()  # set with closed: wakes the watchdog (only then)
        self.reading = False      # a sender is reading answers for everyone
        self.timed_out = False    # the call was cancelled because an answer was late
        self.last_sent = time.monotonic()  # when a request last went out (idle close)
        self.method = method
        self.region: SharedRing | None = None  # this call's insert region, once mapped
        self.no_region = ""  # why this call has none (the server said so): not asked again
        self.call = connection.method(method, kind="stream_stream")(
            self._requests(),
            metadata=connection.metadata + request_bytes_metadata(STREAM_MESSAGE_BYTES))

    def _requests(self) -> Iterator[bytes]:
        while True:
            raw = self.outgoing.get()
            if raw is None:
                return
            yield raw


class CallStream:
    """A client's CallStream for one kind of request (see the module docstring).

    Answers are read by the senders themselves: one waiting sender at a time
    reads the next answers from the call and hands each to its sender, until
    its own is in (no reader thread between the network and the caller). A
    small watchdog thread per open call cancels it when an answer is later
    than the connection's timeout.

    Args:
        connection: the server.
        kind: the requests it carries: ``"update_priorities"``, ``"insert"`` or
            ``"sample"`` (same-host samples through its region only:
            :meth:`sample_in_region`; samples may wait on the server, as inserts).
        window: requests that may be unanswered at once (``None``: 64 updates, which
            never wait on the server; one insert, which may wait for its rate limiter,
            while other threads' inserts go unary, so an insert held for one table never
            holds another thread's insert into another).
    """

    def __init__(self, connection: Connection, kind: str, window: int | None = None) -> None:
        self._connection = connection
        self._kind = kind
        updates = kind == "update_priorities"
        self._methods = list(UPDATES if updates else INSERTS)
        # Updates never wait on the server: they share the stream. Anything else may wait
        # (an insert for its rate limiter): one at a time, the others go unary meanwhile.
        self._exclusive = window is None and not updates
        self._slots = threading.BoundedSemaphore(
            window if window is not None else DEFAULT_WINDOW if updates else 1)
        self._cond = threading.Condition(threading.Lock())
        self._session: _Session | None = None
        self._refused_until = 0.0
        self._no_regions = "" if os.environ.get("REPLAY_SHARED_MEMORY", "1") != "0" else \
            "REPLAY_SHARED_MEMORY=0"  # why no call of this stream asks for a region (a channel)
        self._local = LocalUpdates(self._ask_local, self._touch, connection.address) \
            if updates else None

    @property
    def supported(self) -> bool:
        """False once the server answered UNIMPLEMENTED to every name: every request goes unary."""
        return bool(self._methods)

    def send(self, request: bytes) -> pb.CallStreamResponse:
        """Send one encoded request of this stream's kind and wait for its answer.

        Raises:
            StreamFallback: the request did not go on the stream; send it unary.
            DeadlineExceededError: no answer within the connection's timeout.
            UnavailableError: the stream broke while an insert was in hand (it may or may
                not have been stored).
            ReplayError: the server refused the request (its typed error).
        """
        if not self._methods:
            raise StreamFallback(f"the server has no CallStream for {self._kind}")
        if len(request) + _HEADER_BYTES > STREAM_MESSAGE_BYTES:
            raise StreamFallback(f"a request of {len(request)} bytes is larger than the stream's "
                                 f"messages ({STREAM_MESSAGE_BYTES} bytes)")
        if self._local is not None and not self._no_regions:  # same host: a Unix socket
            answer = self._local.send(request, self._connection.timeout)
            if answer is not None:
                if answer.HasField("error"):
                    raise self._error(answer.error)
                return answer
        with self._slot():
            return self._exchange(None, lambda sequence, timeout: messages.encode_call_request(
                sequence, self._kind, request, timeout), repeatable=self._kind == "update_priorities")

    def _ask_local(self) -> pb.LocalChannelOffer | None:
        """A local channel for updates, asked for on the current call (``None``: none now;
        :mod:`replay_client.local_updates`)."""
        if self._no_regions or not self._methods or self._methods[0] != "CallStream":
            return None
        ask = pb.LocalChannelRequest(host_id=host_id()).SerializeToString()
        try:
            with self._slot():
                with self._cond:
                    session = self._current()
                if session.no_region:
                    return None
                try:
                    return self._exchange(session, lambda sequence, timeout: (
                        messages.encode_call_request(sequence, "local_channel", ask, timeout)),
                        repeatable=True, probe=True).local_channel
                except ReplayError as exc:  # refused: not on this call again
                    session.no_region = str(exc)
                    if isinstance(exc, FailedPreconditionError):  # another host, shm off
                        self._no_regions = str(exc)
                    return None
        except StreamFallback:
            return None

    def _touch(self) -> None:
        """An update went over the local channel: the call is in use (not idle)."""
        with self._cond:
            if self._session is not None:
                self._session.last_sent = time.monotonic()

    def send_in_region(self, nbytes: int,
                       parts: list[memoryview | bytes]) -> pb.CallStreamResponse:
        """Send one encoded Insert request of ``nbytes`` (``parts``, written one after
        another) through the call's shared-memory region, asking the server for one first
        if the call has none that large (same host only: :mod:`replay_feed.shared_ring`).

        Raises:
            StreamFallback: no region (another host, shared memory off or over budget on the
                server, an older server, the stream busy or refused): send it chunked.
            Otherwise as :meth:`send`.
        """
        if self._no_regions:
            raise StreamFallback(f"no shared-memory region for inserts ({self._no_regions})")
        with self._slot():
            with self._cond:
                session = self._current()
            region = session.region
            if region is None or region.slot_bytes < nbytes:
                region = self._ask_region(session, nbytes)
            slot = region.slot(0).numpy()
            position = 0
            for part in parts:
                data = np.frombuffer(part, dtype=np.uint8)
                slot[position:position + data.size] = data
                position += data.size
            assert position == nbytes
            return self._exchange(session, lambda sequence, timeout: messages.encode_region_insert(
                sequence, nbytes, timeout), repeatable=False)

    def sample_in_region(self, request: bytes,
                         read: Callable[[bytes, SharedRing], T]) -> T:
        """Send one encoded SampleRequest to be drawn into the call's shared-memory region
        (same host only), asking for a region first, or a larger one when the server says
        the batch needs it; return ``read(batch, region)`` (``batch``: the answer's
        SampleResponse, saying where the tensors lie), which must copy the batch out (the
        region is the next request's). Only on a stream of kind ``"sample"``.

        A sample is repeatable (a non-consuming table's draw changes nothing a client
        relies on; a queue table's retry under the same lease gets the same rows), so a
        stream that breaks falls back to the plain call.

        Raises:
            StreamFallback: no region (another host, shared memory off or over budget on
                the server, a server without regions or without samples in them, a batch
                larger than :data:`REGION_MAX_BYTES`, the stream busy or refused): make the
                Sample call.
            Otherwise as :meth:`send`.
        """
        if self._no_regions:
            raise StreamFallback(f"no shared-memory region for samples ({self._no_regions})")
        with self._slot():
            with self._cond:
                session = self._current()
            if session.no_region:  # refused on this call (its budget): not asked again
                raise StreamFallback(f"no shared-memory region ({session.no_region})")
            for _ in range(3):  # the first without a region: the server says what it needs
                answer = self._exchange(
                    session, lambda sequence, timeout: messages.encode_call_request(
                        sequence, "sample_in_region", request, timeout),
                    repeatable=True, probe=True).sampled_in_region
                region = session.region
                if answer.batch and region is not None:
                    return read(answer.batch, region)
                needed = answer.region_bytes
                if not 0 < needed <= REGION_MAX_BYTES:
                    raise StreamFallback(f"a batch of {needed:,} bytes does not go through a "
                                         f"region (at most {REGION_MAX_BYTES:,} bytes)")
                self._ask_region(session, needed, SAMPLE_REGION_MIN_BYTES)
            raise StreamFallback("the server's region stayed too small for the batch")

    @contextmanager
    def _slot(self) -> Iterator[None]:
        """Hold a slot of the window for one request (see the module docstring).

        Raises:
            StreamFallback: the stream was refused a moment ago, or (inserts) is busy.
            DeadlineExceededError: no slot within the connection's timeout (updates).
        """
        if time.monotonic() < self._refused_until:
            raise StreamFallback("the server refused a call stream a moment ago")
        timeout = self._connection.timeout
        if self._exclusive and not self._slots.acquire(blocking=False):
            raise StreamFallback(f"another {self._kind} is on the stream (it may wait there)")
        if not self._exclusive and not self._slots.acquire(timeout=timeout):
            raise DeadlineExceededError(
                f"no room on the call stream to {self._connection.address} within "
                f"{timeout} s (every slot waits for an answer)")
        try:
            yield
        finally:
            self._slots.release()

    def _current(self) -> _Session:
        """The open call, or a new one if it ended (idle) or there is none. Under the lock."""
        session = self._session
        if session is None or session.closed or session.call.done():  # ended idle
            if not self._methods:
                raise StreamFallback(f"the server has no CallStream for {self._kind}")
            session = self._session = self._open()
        return session

    def _exchange(self, session: _Session | None,
                  encode: Callable[[int, float | None], bytes], *, repeatable: bool,
                  probe: bool = False) -> pb.CallStreamResponse:
        """Send one request (``encode(sequence, timeout)``) on ``session`` (``None``: the
        current call, or a new one) and wait for its answer; holding a slot.

        Raises:
            StreamFallback: ``session`` ended before it was sent, or as :meth:`send`.
        """
        timeout = self._connection.timeout
        pending = _Pending(None if timeout is None else time.monotonic() + timeout,
                           repeatable=repeatable, probe=probe)
        with self._cond:
            if session is None:
                session = self._current()
            elif session.closed:
                raise StreamFallback("the call stream ended")
            session.pending.append(pending)
            session.last_sent = time.monotonic()
            session.outgoing.put(encode(session.sequence, timeout))
            session.sequence += 1
        self._wait(session, pending)
        if pending.error is not None:
            raise pending.error
        assert pending.answer is not None
        return pending.answer

    def _ask_region(self, session: _Session, nbytes: int,
                    least: int = REGION_MIN_BYTES) -> SharedRing:
        """Ask the server for a region of at least ``nbytes`` (a power of two, at least
        ``least``) on ``session`` and map it; the session's region from then on (the server
        replaces its earlier one).

        Raises:
            StreamFallback: the server has none to give (it said why), or it cannot be mapped
                here (another host after all, another container's /dev/shm).
        """
        if session.no_region:
            raise StreamFallback(f"no shared-memory region ({session.no_region})")
        want = min(max(least, 1 << (nbytes - 1).bit_length()), REGION_MAX_BYTES)
        ask = pb.SharedInsertRegion(host_id=host_id(), bytes=want).SerializeToString()
        try:
            offer = self._exchange(session, lambda sequence, timeout: messages.encode_call_request(
                sequence, "insert_region", ask, timeout), repeatable=True, probe=True).region_offer
        except ReplayError as exc:  # the server's refusal: not on this call again
            session.no_region = str(exc)
            if isinstance(exc, FailedPreconditionError):  # another host, or shared memory off
                self._no_regions = str(exc)  # that server never has one for this client
                if self._kind == "sample":  # a sample stream without a region serves nothing
                    self._end(session)
            raise StreamFallback(f"no shared-memory region ({exc})") from None
        ring: SharedRing | None = None
        try:
            ring = SharedRing.open(offer.name, offer.token, offer.slots, offer.slot_bytes,
                                   offer.header_bytes)
            ring.unlink()  # both sides hold a mapping: nothing is left in /dev/shm
            answer = pb.SharedMemoryAnswer(accepted=True)
        except SharedMemoryError as exc:
            answer = pb.SharedMemoryAnswer(accepted=False, reason=str(exc))
        said = answer.SerializeToString()
        try:
            self._exchange(session, lambda sequence, timeout: messages.encode_call_request(
                sequence, "region_answer", said, timeout), repeatable=True)
        except ReplayError as exc:  # refused (or no answer in time): this call goes without
            if ring is not None:
                ring.close()
            session.no_region = str(exc)
            raise StreamFallback(f"no shared-memory region ({exc})") from None
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        if ring is None:
            self._no_regions = answer.reason  # this host cannot map the server's regions
            log.info("cannot map the server's shared-memory region for %ss (%s); they go "
                     "as plain calls", self._kind, answer.reason)
            raise StreamFallback(f"no shared-memory region ({answer.reason})")
        if session.region is not None:
            session.region.close()
        session.region = ring
        return ring

    def close(self) -> None:
        """End the stream (requests in flight get StreamFallback if unanswered; an insert in
        the server's hands, UnavailableError)."""
        if self._local is not None:
            self._local.close()
        self._end(None)

    def _end(self, only: _Session | None) -> None:
        """End the current call (``only``: if it is that one), as :meth:`close` says."""
        with self._cond:
            session = self._session
            if only is not None and session is not only:
                return
            self._session = None
            if session is not None:
                session.outgoing.put(None)  # half-close: the server answers what it has, then ends
                session.closed = True
                session.ended.set()
                self._cond.notify_all()
        if session is not None:
            session.call.cancel()
            with self._cond:
                self._fail(session, StreamFallback("the call stream was closed"))

    # ------------------------------------------------------------ answers

    def _open(self) -> _Session:
        session = _Session(self._connection, self._methods[0])
        if self._connection.timeout is not None:
            threading.Thread(target=self._watch, args=(session, self._connection.timeout),
                             name="call-stream-watchdog", daemon=True).start()
        return session

    def _wait(self, session: _Session, pending: _Pending) -> None:
        """Until ``pending`` is answered: wait, or read answers for everyone while nobody does."""
        with self._cond:
            while not pending.finished:
                if not session.reading:
                    session.reading = True
                    break
                self._cond.wait()
            else:
                return
        try:
            while not pending.finished:
                self._read_one(session)
        finally:
            with self._cond:
                session.reading = False
                self._cond.notify_all()

    def _read_one(self, session: _Session) -> None:
        handled = True  # whether the request in the server's hands may have been applied
        try:
            raw = next(session.call)
            answer = pb.CallStreamResponse.FromString(raw)
        except StopIteration:
            why: BaseException = StreamFallback("the call stream ended")
        except grpc.RpcError as exc:
            code = exc.code()
            handled = code not in NOT_HANDLED and not drained(exc) and not never_sent(exc)
            with self._cond:
                probe = bool(session.pending) and session.pending[0].probe
            if probe and code == grpc.StatusCode.INVALID_ARGUMENT:  # a server before regions
                self._no_regions = f"the server at {self._connection.address} has none"
                log.info("server at %s has no shared-memory regions for %ss; they go as "
                         "plain calls", self._connection.address, self._kind)
            elif code == grpc.StatusCode.UNIMPLEMENTED:
                with self._cond:
                    if self._methods and self._methods[0] == session.method:
                        self._methods.pop(0)
                log.info("server at %s has no %s; %s", self._connection.address, session.method,
                         f"{self._kind} goes on {self._methods[0]}" if self._methods
                         else f"{self._kind} goes unary")
            elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
                self._refused_until = time.monotonic() + REFUSED_RETRY_S
                log.info("server at %s refused a call stream (%s); %s goes unary for %g s",
                         self._connection.address, exc.details(), self._kind, REFUSED_RETRY_S)
            why = StreamFallback(f"the call stream ended: {code.name}")
        except Exception as exc:  # a malformed answer: the stream cannot be trusted further
            session.call.cancel()
            why = StreamFallback(f"the call stream failed: {exc!r}")
        else:
            self._connection.answered = True  # the server is there (its retry window)
            with self._cond:
                pending = session.pending.popleft()
                if answer.HasField("error"):
                    pending.error = self._error(answer.error)
                else:
                    pending.answer = answer
                pending.finished = True
                self._cond.notify_all()
            return
        with self._cond:
            self._fail(session, why, handled)

    def _fail(self, session: _Session, why: BaseException, handled: bool = True) -> None:
        """The call is over: every unanswered request gets ``why`` (late ones: the deadline;
        the oldest, if ``handled`` may have applied it and it is not repeatable: in doubt).
        Under the lock."""
        session.closed = True
        session.ended.set()
        if self._session is session:
            self._session = None
        session.outgoing.put(None)
        if session.region is not None:  # the server's region ended with the call
            session.region.close()
            session.region = None
        now = time.monotonic()
        for position, pending in enumerate(session.pending):
            late = session.timed_out and pending.deadline is not None and now >= pending.deadline
            if late:
                pending.error = DeadlineExceededError(
                    f"call to replay server at {self._connection.address} timed out: no answer "
                    f"to {self._kind} within {self._connection.timeout} s")
            elif position == 0 and handled and not pending.repeatable:
                pending.error = UnavailableError(
                    f"the call stream to replay server at {self._connection.address} ended "
                    f"({why}) while the server had this {self._kind}: it may or may not have "
                    f"been applied")
            else:
                pending.error = why
            pending.finished = True
        session.pending.clear()
        self._cond.notify_all()

    def _watch(self, session: _Session, timeout: float) -> None:
        """Cancel ``session``'s call once its oldest unanswered request is past its deadline,
        and end it once nothing was sent on it for :data:`IDLE_CLOSE_S` (the server gives its
        slot and reservation back; the next request opens a new call).

        It looks every quarter of the timeout (at most a second) and when the call ends, on
        an event of its own: woken by every answer (it once waited on the senders' condition),
        it cost a thread switch per request, 16% of a waiting update's client CPU."""
        period = min(1.0, timeout / 4)
        while not session.ended.wait(period):
            now = time.monotonic()
            with self._cond:
                oldest = session.pending[0].deadline if session.pending else None
                idle = not session.pending and now - session.last_sent >= IDLE_CLOSE_S
                if idle:  # under the lock: no sender can append to it any more
                    session.closed = True
                    session.ended.set()
                    if self._session is session:
                        self._session = None
                    session.outgoing.put(None)
            if idle:
                session.call.cancel()
                return
            if oldest is not None and now >= oldest:
                session.timed_out = True
                session.call.cancel()
                return

    def _error(self, error: pb.CallError) -> BaseException:
        return call_error(error, self._connection.address)
