"""``BatchStream``: the learner's iterator over a feed, and the thread that fills it.

See :mod:`replay_feed.core` for what happens to each batch on the way.

Exit: a learner script may end (normally, by an exception or by Ctrl-C)
with a stream still open. Every open stream is closed by an ``atexit``
hook, before the interpreter freezes its daemon threads: a stream closed
later (by the garbage collector during shutdown) could wait forever on a
lock that a frozen thread holds (a gRPC call's), which is how learners used
to hang at exit. The hook gives each stream :data:`EXIT_CLOSE_S` seconds.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

from replay_feed.core import FeedCore, Source
from replay_feed.delivery import Delivery
from replay_feed.eager import runs_eagerly

log = logging.getLogger("replay.feed")

EXIT_CLOSE_S = 2.0
"""How long the exit hook waits for each open stream's thread to end."""

LATE_ACK_S = 5.0
"""How long a stream left (``break``) holding a leased batch not finished waits for a
late :meth:`BatchStream.ack` before it ends, giving that batch back."""

_open: weakref.WeakSet[BatchStream] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hooked = False


def _close_open_streams() -> None:
    """The exit hook: close every stream still open (see the module docstring)."""
    for stream in list(_open):
        try:
            stream.close(timeout=EXIT_CLOSE_S)
        except Exception:  # pragma: no cover - best effort at exit
            pass


def _track(stream: BatchStream) -> None:
    global _hooked
    with _hook_lock:
        if not _hooked:
            # Registered at the first stream, so after grpc's own hooks: atexit runs it first.
            atexit.register(_close_open_streams)
            _hooked = True
        _open.add(stream)


class StreamEndedError(RuntimeError):
    """:meth:`BatchStream.ack` after the stream ended holding a leased batch not finished:
    that batch went back to the queue when the stream ended (closed, broken, or left
    :data:`LATE_ACK_S` earlier), so it was not acknowledged and will be handed out again."""


class BatchStream:
    """The learner's iterator over a feed: ``for batch in stream: ...``.

    Breaking out of the loop, leaving a ``with`` block, :meth:`close` or
    garbage collection stops the background thread, cancels the source and
    releases its buffers (shared memory included). Errors of the source
    reach the learner as the exceptions the source raised, after the
    batches that came before them.

    Attributes:
        stats: batches and bytes delivered, time waited, transport, notes.
    """

    def __init__(self, core: FeedCore, source: Source, name: str, *,
                 ended_error: type[Exception] = StreamEndedError) -> None:
        self._core = core
        self._source = source
        self._name = name
        self._ended_error = ended_error  # what a late ack() raises (the entry's typed class)
        self._gave_back = False  # the stream ended holding a leased batch not finished
        self.stats = core.stats
        self.stats.notes.append(core.delivery.note)
        self._thread = threading.Thread(
            target=_produce, args=(core, source), name=f"replay-stream-{name}", daemon=True)
        self._closed = False
        self._left = False  # a for loop over it was left holding a leased batch (see _leave)
        self._close_lock = threading.Lock()
        self._late_ack: threading.Timer | None = None
        _track(self)
        self._thread.start()

    @property
    def delivery(self) -> Delivery:
        """What was decided about device and pinning."""
        return self._core.delivery

    @property
    def pinned(self) -> bool:
        """Whether batches (or the host side of their device copies) are page-locked."""
        return self._core.delivery.pin

    @property
    def window(self) -> int:
        """Batches that may be in flight or buffered ahead of the learner now (``prefetch``,
        or what the stream widened it to over a slow link)."""
        return self._core.window

    @property
    def transport(self) -> str:
        """How batches travel: ``shared_memory``, ``grpc`` or ``in_process``."""
        return self.stats.transport

    def __iter__(self):
        try:
            while True:
                yield self.__next__()
        except StopIteration:
            return
        finally:
            self._leave()

    def _leave(self) -> None:
        """A ``for`` loop over the stream ended: the stream ends, unless it holds a leased
        batch not finished. Then it ends :data:`LATE_ACK_S` later (or at :meth:`close`),
        so that the ``ack()`` a learner writes after ``break`` still acknowledges that
        batch; it hands out nothing more meanwhile."""
        if self._closed or self._left:
            return
        if not (self._core.holds_unfinished() and getattr(self._source, "leased", False)):
            self.close()
            return
        self._left = True
        timer = self._late_ack = threading.Timer(LATE_ACK_S, _close_left, (weakref.ref(self),))
        timer.daemon = True
        timer.start()

    @runs_eagerly
    def __next__(self) -> Any:
        if self._closed or self._left:
            raise StopIteration
        try:
            batch = self._core.take()
            if self.stats.batches == 1:
                log.info("stream %s: %s (%s)", self._name, self.stats.transport,
                         "; ".join(self.stats.notes))
            return batch
        except StopIteration:
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    @runs_eagerly
    def update_priorities(self, ids: Any, priorities: Any) -> None:
        """Set priorities of rows this stream delivered; they ride on the next credit.

        Returns at once (no round trip): the update is checked here, queued
        with the learner's credits, and sent before the credit that the next
        ``next()`` grants, so the server applies it before it draws any batch
        that credit allows. Batches already drawn (up to the window ahead)
        were drawn before it. Ids may be any shape (as the batch's ``ids``);
        updates of ids the server refuses (never issued, another table's)
        end the stream with that typed error.

        Raises:
            InvalidIdsError, InvalidPriorityError: (the entry's typed errors)
                checked here, nothing queued.
            NotImplementedError: this stream takes no priority updates.
        """
        update = self._source.check_update(ids, priorities)
        self._core.update_priorities(update)

    def ack(self) -> None:
        """Say the learner finished the batch it holds now, before it asks for the next.

        On a queue table (``fifo``/``lifo``) a stream's batches are leased:
        a batch is finished when the learner asks for the next one, or by
        this call; when the stream ends (closed, broken, or the learner's
        process dies) the server returns every batch not finished to the
        queue, for the next learner (docs/service.md, "Delivery"). So call
        it for the last batch before :meth:`close`, once that batch's work
        is done, or the batch is handed out again. Returns at once (the
        acknowledgement travels with the next message); a no-op when no
        batch is held or on other tables.

        After leaving a ``for`` loop (``break``) holding a leased batch, the
        stream waits :data:`LATE_ACK_S` for this call before it ends: an
        ``ack()`` then acknowledges that batch and ends the stream (it hands
        out nothing more once the loop was left).

        Raises:
            StreamEndedError: (the entry's typed subclass) the stream had ended
                holding a leased batch not finished: that batch went back to the
                queue, unacknowledged.
        """
        if not self._closed:
            self._core.ack()
            if self._left:
                self.close()  # the learner is done with it: the acknowledgement goes now
        elif self._gave_back:
            raise self._ended_error(
                f"stream {self._name}: ack() after the stream ended: the batch it held was "
                f"not finished then and went back to the queue (it will be handed out again). "
                f"Call stream.ack() before close(), and within {LATE_ACK_S:g} s of leaving a "
                f"for loop over the stream (a stream left holding a batch ends then)")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the background work and release buffers; idempotent. On a queue table the
        batches not finished (prefetched, and the one held unless :meth:`ack` finished it)
        return to the queue."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._late_ack is not None:
            self._late_ack.cancel()
        self._gave_back = self._core.holds_unfinished() and bool(
            getattr(self._source, "leased", False))
        _open.discard(self)
        self._core.stop()
        self._source.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("stream thread %s did not stop within %.0f s", self._thread.name, timeout)
        self._core.release()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=2.0)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _close_left(ref: weakref.ref[BatchStream]) -> None:
    """A left stream's late ack did not come in time: it ends, giving its batches back."""
    stream = ref()
    if stream is not None and not stream._closed:
        log.info("stream %s: left holding a batch not acknowledged within %g s: it ends, "
                 "and the batch goes back to the queue", stream._name, LATE_ACK_S)
        stream.close()


def _produce(core: FeedCore, source: Source) -> None:
    try:
        source.run(core)
    except BaseException as exc:
        if core.stopping.is_set():
            core.finish()
        else:
            core.fail(exc)
    else:
        core.finish()
