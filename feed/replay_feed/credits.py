"""Credits: how a consumer's window reaches the place batches are drawn, with the updates made meanwhile.

Every stream is credit-driven (:mod:`replay_feed.link`): the producer of
batches (a server's ``SampleStream``, an in-process table, one shard of a
sharded stream) may run only as far ahead as the consumer granted. The
consumer grants ``window`` credits when a call opens, then one per batch it
has finished with; it may also *grow* the window (extra credits, see
:mod:`replay_feed.window`). Priority updates the consumer makes between two
batches travel in the same queue, in the order they were made, so they reach
the producer no later than the credit that follows them: the producer applies
them before it draws any batch that credit allows.

:class:`CreditQueue` carries credits and updates from the consumer's threads
to the one thread that forwards them (a gRPC call's request iterator, an
in-process table's draw loop); :class:`CreditFlow` adds the window's
accounting across calls (a call reopened after a lost connection grants what
the consumer has room for, no more).

Thread-safety: :class:`CreditQueue` may be fed from any thread and read by
one; :class:`CreditFlow` is read by one thread (the link's forwarder) and
grown from any.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RIDE_MAX_IDS = 4096
"""Updates held for the next credit go without it once they hold this many ids (a learner
updating faster than it takes batches does not pile them up)."""

_STOP: Any = object()
_WAKE: Any = object()


@dataclass(frozen=True, slots=True)
class PriorityUpdate:
    """New priorities for ids of the stream's table: flat int64 ids, float64 priorities."""

    ids: np.ndarray
    priorities: np.ndarray


@dataclass(slots=True)
class Grant:
    """What the consumer sends at once: ``credits`` more batches, after ``updates``;
    ``finished``: batches the consumer finished meanwhile (see :class:`CreditFlow`)."""

    credits: int = 0
    updates: list[PriorityUpdate] = field(default_factory=list)
    finished: int = 0

    def __bool__(self) -> bool:
        return bool(self.credits or self.updates or self.finished)


class CreditQueue:
    """Credits and updates in the order the consumer made them (see the module docstring).

    Args:
        release: called on the reading thread for each credit's token before
            the credit counts (the feed waits there for the device copy out
            of the batch given back, and frees its staging slot).
    """

    def __init__(self, release: Callable[[Any], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._release = release
        self.stopping = threading.Event()

    def credit(self, token: Any = None, finished: bool = False) -> None:
        """One more batch may be produced (``token``: handed to ``release`` first);
        ``finished``: the consumer also finished a batch (the one it gave back)."""
        self._queue.put(("credit", token, finished))

    def finish(self) -> None:
        """The consumer finished a batch it still holds (no credit: it gives it back later)."""
        self._queue.put(("finished",))

    def update(self, update: PriorityUpdate) -> None:
        """Priorities to apply before the batches the next credits allow are drawn."""
        self._queue.put(("update", update))

    def wake(self) -> None:
        """Make a waiting :meth:`take` return (with an empty grant if nothing came)."""
        self._queue.put(_WAKE)

    def stop(self) -> None:
        """End: :meth:`take` returns what is pending, then ``None`` from then on."""
        self.stopping.set()
        self._queue.put(_STOP)

    def take(self, block: bool = True) -> Grant | None:
        """Everything queued (waiting for something if ``block``); ``None`` once stopped
        and drained. An empty grant means a :meth:`wake` (or nothing, when not ``block``)."""
        items = []
        if block:
            items.append(self._queue.get())
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        grant = Grant()
        stopped = False
        for item in items:
            if item is _STOP:
                stopped = True
            elif item is _WAKE:
                continue
            elif item[0] == "update":
                grant.updates.append(item[1])
            elif item[0] == "finished":
                grant.finished += 1
            else:
                if self._release is not None:
                    self._release(item[1])
                grant.credits += 1
                grant.finished += item[2]
        if stopped:
            self._queue.put(_STOP)  # every later take sees it too
            return grant if grant.updates or grant.finished else None
        return grant


class CreditFlow:
    """A consumer's window over a :class:`CreditQueue`, across the calls of one stream.

    ``window`` batches may be in flight or buffered ahead of the consumer:
    a call opens with ``window + finished - received`` credits (what the
    consumer has room for now) and forwards every later grant as it comes.

    It also counts the batches the consumer *finished* (:attr:`finished`: the
    first that many batches of the stream, in order), which a link reports to
    a producer that leases them (a queue table's ``SampleStream``:
    :mod:`replay_client.stream`); a call counts only its own batches.

    Args:
        credits: the consumer's queue.
        window: the initial window (>= 1).
        ride: priority updates wait for the next credit and travel in its message
            (a learner's stream: one message per batch taken); ``False``: they
            go at once, in a message of their own (a shard of a sharded stream,
            whose credits come only as the merge uses its rows). Held updates go
            without a credit once they hold :data:`RIDE_MAX_IDS` ids. Either way
            an update reaches the producer before the credits granted after it.
    """

    def __init__(self, credits: CreditQueue, window: int, *, ride: bool = True) -> None:
        self._credits = credits
        self._ride = ride
        self._lock = threading.Lock()
        self.window = window
        self._finished = 0      # credits forwarded (one per batch the consumer finished)
        self._received = 0      # batches that arrived
        self._extra = 0         # window growth not forwarded yet
        self._unsent: list[PriorityUpdate] = []  # taken for a call that ended before sending
        self._done = 0          # batches the consumer finished, the stream's first ones

    @property
    def finished(self) -> int:
        """Batches of the stream the consumer finished so far (its first ones, in order)."""
        return self._done

    @property
    def stopping(self) -> threading.Event:
        return self._credits.stopping

    def grow(self, by: int) -> None:
        """Widen the window by ``by`` batches (sent with the next grant). Any thread."""
        if by > 0:
            with self._lock:
                self.window += by
                self._extra += by
            self._credits.wake()

    def arrived(self, count: int = 1) -> None:
        """``count`` batches arrived (the link's reading thread)."""
        with self._lock:
            self._received += count

    def opening(self) -> tuple[int, list[PriorityUpdate]] | None:
        """Credits a new call opens with, waiting while the consumer has no room, and the
        updates it carries first (``None``: the stream is stopping)."""
        updates: list[PriorityUpdate] = []
        while True:
            with self._lock:
                self._extra = 0
                # At most the window: a consumer waiting for its next batch has granted its
                # credit already (it holds none), and a ring is sized by the window.
                room = min(self.window, self.window + self._finished - self._received)
                updates, self._unsent = self._unsent + updates, []
            if room >= 1:
                return room, updates
            grant = self._credits.take()
            if grant is None:
                return None
            with self._lock:
                self._finished += grant.credits
                self._done += grant.finished
            updates += grant.updates

    def next_grant(self, block: bool = True) -> Grant | None:
        """The next grant to forward on the open call: blocking until there is one, or
        until a :meth:`wake` (an empty grant); ``None``: stopping (updates still held then
        come first, in a grant of their own)."""
        while True:
            grant = self._credits.take(block)
            with self._lock:
                if grant is None:
                    if not self._unsent:
                        return None
                    grant, self._unsent = Grant(0, self._unsent), []
                    return grant
                self._finished += grant.credits
                self._done += grant.finished
                grant.credits += self._extra
                self._extra = 0
                grant.updates[:0], self._unsent = self._unsent, []
                held = sum(u.ids.size for u in grant.updates)
                if (self._ride and grant.updates and not grant.credits and not grant.finished
                        and held < RIDE_MAX_IDS):
                    self._unsent = grant.updates  # they ride on the next credit
                    if not block:
                        return Grant()
                    continue
            return grant

    def unsent(self, grant: Grant) -> None:
        """``grant`` was taken for a call that has ended: its updates go with the next call's
        first message (its credits are counted already)."""
        if grant.updates:
            with self._lock:
                self._unsent = grant.updates + self._unsent

    def wake(self) -> None:
        """Make a waiting :meth:`next_grant` return (an empty grant). Any thread."""
        self._credits.wake()
