"""Priority updates on one persistent ``UpdateStream`` call, so a waiting update costs a round trip.

``update_priorities(..., wait=True)`` used to be a unary call each time
(about 0.6 ms of Python gRPC on the project's machine, most of it setting up
and tearing down the call). :class:`UpdateStream` keeps one bidirectional
call open per client and process: a request is one message out, its answer
one message back (about 0.4 ms), matched by order (the server answers in the
order it was sent; ``replay.proto`` documents the messages).

Bounds: at most ``window`` requests are unanswered at once; a sender beyond
that waits for a slot (within its timeout). Each request waits at most the
connection's timeout (to within a quarter of it, at most a second) for its
answer; past it the call is cancelled: the late request raises
:class:`~replay_client.errors.DeadlineExceededError`, the others in flight
go the unary way.

The call declares messages of at most
:data:`~replay_proto.call_metadata.STREAM_MESSAGE_BYTES` (64 KiB, about 5,000
ids): the server reserves that much for it. A larger update is not sent on
the stream.

When a request cannot go this way (it is larger than that, the server is too
old to know the RPC, the stream broke, or the server is draining), :meth:`UpdateStream.send`
raises :class:`StreamFallback` and the caller makes the unary call instead,
which has the client's retry policy. A server that answered UNIMPLEMENTED is
not asked again. A request the server refused raises its own typed error,
exactly as the unary call would have.

Thread-safety: :meth:`send` may be called from any thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator

import grpc

from replay_client.connection import Connection
from replay_client.errors import (
    DeadlineExceededError,
    ReplayError,
    UnavailableError,
    from_status,
)
from replay_proto import messages
from replay_proto.call_metadata import STREAM_MESSAGE_BYTES, request_bytes_metadata
from replay_proto.error_kinds import ErrorKind
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.update_stream")

DEFAULT_WINDOW = 64
"""Requests one client may have unanswered on its stream."""

_SEQUENCE_BYTES = 16
"""Room an UpdateStreamRequest adds around its update (sequence and field tags)."""


class StreamFallback(Exception):
    """This request did not go on the stream (nothing of it was applied): make the unary call."""


class _Pending:
    """One request waiting for its answer."""

    __slots__ = ("deadline", "finished", "answer", "error")

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.finished = False
        self.answer: pb.UpdatePrioritiesResponse | None = None
        self.error: BaseException | None = None


class _Session:
    """One open UpdateStream call: its outgoing queue and its unanswered requests, in order."""

    def __init__(self, connection: Connection) -> None:
        self.outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.pending: deque[_Pending] = deque()
        self.sequence = 0
        self.closed = False
        self.ended = threading.Event()  # set with closed: wakes the watchdog (only then)
        self.reading = False      # a sender is reading answers for everyone
        self.timed_out = False    # the call was cancelled because an answer was late
        self.call = connection.method("UpdateStream", kind="stream_stream")(
            self._requests(),
            metadata=connection.metadata + request_bytes_metadata(STREAM_MESSAGE_BYTES))

    def _requests(self) -> Iterator[bytes]:
        while True:
            raw = self.outgoing.get()
            if raw is None:
                return
            yield raw


class UpdateStream:
    """A client's UpdateStream (see the module docstring).

    Answers are read by the senders themselves: one waiting sender at a time
    reads the next answers from the call and hands each to its sender, until
    its own is in (no reader thread between the network and the caller). A
    small watchdog thread per open call cancels it when an answer is later
    than the connection's timeout.

    Args:
        connection: the server.
        window: requests that may be unanswered at once.
    """

    def __init__(self, connection: Connection, window: int = DEFAULT_WINDOW) -> None:
        self._connection = connection
        self._slots = threading.BoundedSemaphore(window)
        self._cond = threading.Condition(threading.Lock())
        self._session: _Session | None = None
        self.supported = True
        """False once the server answered UNIMPLEMENTED: every request goes unary."""

    def send(self, update: bytes) -> pb.UpdatePrioritiesResponse:
        """Send one encoded UpdatePrioritiesRequest and wait for its answer.

        Raises:
            StreamFallback: the request did not go on the stream; send it unary.
            DeadlineExceededError: no answer within the connection's timeout.
            ReplayError: the server refused the request (its typed error).
        """
        if not self.supported:
            raise StreamFallback("the server has no UpdateStream")
        if len(update) + _SEQUENCE_BYTES > STREAM_MESSAGE_BYTES:
            raise StreamFallback(f"an update of {len(update)} bytes is larger than the stream's "
                                 f"messages ({STREAM_MESSAGE_BYTES} bytes)")
        timeout = self._connection.timeout
        if not self._slots.acquire(timeout=timeout):
            raise DeadlineExceededError(
                f"no room on the update stream to {self._connection.address} within "
                f"{timeout} s (every slot waits for an answer)")
        try:
            pending = _Pending(None if timeout is None else time.monotonic() + timeout)
            with self._cond:
                session = self._session
                if session is None or session.closed:
                    session = self._session = self._open()
                session.pending.append(pending)
                session.outgoing.put(
                    messages.encode_update_stream_request(session.sequence, update))
                session.sequence += 1
            self._wait(session, pending)
            if pending.error is not None:
                raise pending.error
            assert pending.answer is not None
            return pending.answer
        finally:
            self._slots.release()

    def close(self) -> None:
        """End the stream (requests in flight get StreamFallback if unanswered)."""
        with self._cond:
            session, self._session = self._session, None
            if session is not None:
                session.outgoing.put(None)  # half-close: the server answers what it has, then ends
                session.closed = True
                session.ended.set()
                self._cond.notify_all()
        if session is not None:
            session.call.cancel()
            with self._cond:
                self._fail(session, StreamFallback("the update stream was closed"))

    # ------------------------------------------------------------ answers

    def _open(self) -> _Session:
        session = _Session(self._connection)
        if self._connection.timeout is not None:
            threading.Thread(target=self._watch, args=(session, self._connection.timeout),
                             name="update-stream-watchdog", daemon=True).start()
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
        try:
            raw = next(session.call)
            answer = pb.UpdateStreamResponse.FromString(raw)
        except StopIteration:
            why: BaseException = StreamFallback("the update stream ended")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                log.info("server at %s has no UpdateStream; priority updates go unary",
                         self._connection.address)
            why = StreamFallback(f"the update stream ended: {exc.code().name}")
        except Exception as exc:  # a malformed answer: the stream cannot be trusted further
            session.call.cancel()
            why = StreamFallback(f"the update stream failed: {exc!r}")
        else:
            with self._cond:
                pending = session.pending.popleft()
                if answer.HasField("error"):
                    pending.error = self._error(answer.error)
                else:
                    pending.answer = answer.update_priorities
                pending.finished = True
                self._cond.notify_all()
            return
        with self._cond:
            self._fail(session, why)

    def _fail(self, session: _Session, why: BaseException) -> None:
        """The call is over: every unanswered request gets ``why`` (late ones: the deadline). Under the lock."""
        session.closed = True
        session.ended.set()
        if self._session is session:
            self._session = None
        session.outgoing.put(None)
        now = time.monotonic()
        for pending in session.pending:
            late = session.timed_out and pending.deadline is not None and now >= pending.deadline
            pending.error = DeadlineExceededError(
                f"call to replay server at {self._connection.address} timed out: no answer to "
                f"a priority update within {self._connection.timeout} s") if late else why
            pending.finished = True
        session.pending.clear()
        self._cond.notify_all()

    def _watch(self, session: _Session, timeout: float) -> None:
        """Cancel ``session``'s call once its oldest unanswered request is past its deadline.

        It looks every quarter of the timeout (at most a second) and when the call ends, on
        an event of its own: woken by every answer (it once waited on the senders' condition),
        it cost a thread switch per request, 16% of a waiting update's client CPU."""
        period = min(1.0, timeout / 4)
        while not session.ended.wait(period):
            with self._cond:
                oldest = session.pending[0].deadline if session.pending else None
            if oldest is not None and time.monotonic() >= oldest:
                session.timed_out = True
                session.call.cancel()
                return

    def _error(self, error: pb.CallError) -> BaseException:
        """The typed error of one refused request (UNAVAILABLE: go unary, which retries)."""
        try:
            kind: ErrorKind | None = ErrorKind(error.kind)
        except ValueError:
            kind = None
        code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN)
        typed: ReplayError = from_status(code, kind, error.message, self._connection.address)
        if isinstance(typed, UnavailableError):
            return StreamFallback(str(typed))
        return typed
