"""The credit-driven stream skeleton: a *link* to where batches are drawn, and the loop that runs it.

A :class:`Link` is one transport's way to draw batches: a server's
``SampleStream`` over gRPC, the same call reading a same-host shared-memory
ring, a table in this process, or a sharded stream's merge of many links.
Whatever the transport, one *call* runs like this:

1. it opens with the credits the consumer has room for (a
   :class:`~replay_feed.credits.CreditFlow`'s :meth:`opening`), after the
   priority updates still waiting;
2. it forwards every later grant (one credit per batch the consumer has
   finished with, window growth, and the updates made meanwhile, which are
   applied before any batch the credits allow is drawn);
3. it yields batches in order, never more than granted;
4. it ends when the stream has all its batches, when it is stopped, or by
   raising: :class:`LinkLost` when the connection was lost (worth
   reconnecting), any other exception to end the stream with it.

:class:`LinkRunner` is the loop around calls that every stream shares: it
opens calls, counts batches (``num_batches``), reconnects after a lost call
with the one backoff schedule (:class:`~replay_feed.backoff.Backoff`) within
the retry window, and gives up with the transport's own error. A new kind
of stream is one :class:`Link` built in the entry that opens its streams; a
new way to move a server's ``SampleStream`` batches is not a link but a
sink/source pair under the one ``SampleLink`` (``docs/learner.md``, "A new
transport").

Thread-safety: a runner's :meth:`~LinkRunner.batches` runs on one thread;
:meth:`~LinkRunner.stop` may be called from any.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from replay_feed.backoff import Backoff
from replay_feed.credits import CreditFlow, PriorityUpdate
from replay_proto.batch import SampleBatch

log = logging.getLogger("replay.feed")


class LinkLost(Exception):
    """A call's connection was lost (the batch in flight with it); reconnecting may help.

    Args:
        error: what the consumer gets when the stream does not reconnect.
        give_up: the error once the retry window ran out (given the window in seconds).
    """

    def __init__(self, error: BaseException, give_up: Callable[[float], BaseException]) -> None:
        super().__init__(str(error))
        self.error = error
        self.give_up = give_up


class Link(Protocol):
    """One transport's calls (see the module docstring)."""

    @property
    def transport(self) -> str:
        """How batches travel (``grpc``, ``shared_memory``, ``in_process``, ``sharded``)."""

    def call(self, flow: CreditFlow, credits: int, updates: list[PriorityUpdate],
             remaining: int, first: int) -> Iterator[SampleBatch]:
        """One call granting ``credits`` after ``updates``, then ``flow``'s grants; its
        batches in order (``remaining``: batches still wanted, 0: no end; ``first``: the
        stream's index of the call's first batch, for staging).

        Raises:
            LinkLost: the connection was lost.
        """

    def stop(self) -> None:
        """End the call in progress from another thread (:meth:`call` then returns)."""

    def close(self) -> None:
        """Release what the link holds (a mapped ring), once no call runs any more."""

    def after_last(self, flow: CreditFlow) -> None:
        """The stream has all its batches (``num_batches``), a window of which the learner
        may not have taken yet: deliver the updates it makes for them until ``flow`` stops
        (:func:`apply_until_stopping`), or nothing, for a link whose open call forwards
        them itself."""


def drawn_here(flow: CreditFlow, credits: int, updates: list[PriorityUpdate], remaining: int,
               first: int, *, apply: Callable[[list[PriorityUpdate]], None],
               draw: Callable[[int], SampleBatch | None],
               stopped: Callable[[], bool],
               draw_group: Callable[[int, int], list[SampleBatch]] | None = None
               ) -> Iterator[SampleBatch]:
    """The call of a link that draws where it runs (a table in this process, the merge of a
    sharded stream's shards): batch ``k`` is drawn only once a credit allows it, and the
    updates that came with (or before) that credit are applied first.

    Args:
        apply: applies priority updates (before any later draw).
        draw: draws batch ``k`` (``None``: stopped meanwhile).
        stopped: whether the link was stopped.
        draw_group: ``draw_group(k, n)`` draws batches ``k, k + 1, ...``: at least one, at
            most ``n`` (every credit granted so far allows them; ``[]``: stopped), so a link
            may make several batches in one pass, as a server draws a group of small
            batches for one message. Updates that come meanwhile apply from the next pass:
            the batches of one pass were allowed by credits granted before them.
    """
    allowance = credits
    apply(updates)
    index = first
    while not stopped() and (not remaining or index - first < remaining):
        grant = flow.next_grant(block=allowance == 0)
        while grant is not None and allowance + grant.credits == 0 and not grant.updates:
            if stopped():
                return
            grant = flow.next_grant()  # woken for nothing: wait on
        if grant is None:
            return
        apply(grant.updates)
        allowance += grant.credits
        if allowance == 0:
            continue
        if draw_group is None:
            batch = draw(index)
            batches = [] if batch is None else [batch]
        else:
            most = allowance if not remaining else min(allowance, remaining - (index - first))
            batches = draw_group(index, most)
        if not batches:
            return
        for batch in batches:
            yield batch
        index += len(batches)
        allowance -= len(batches)


def apply_until_stopping(flow: CreditFlow, apply: Callable[[list[PriorityUpdate]], None]) -> None:
    """:meth:`Link.after_last` of a link that draws where it runs: apply every update the
    learner sends until the stream stops (the updates still held then included). Those of
    the last batches were dropped before: the link had stopped reading the learner's grants
    with its last batch, a window before the learner took it."""
    while True:
        grant = flow.next_grant()
        if grant is None:
            return
        apply(grant.updates)


class LinkRunner:
    """The calls of one stream over ``link`` until it has its batches (see the module docstring).

    Args:
        link: the transport.
        flow: the consumer's credits.
        num_batches: batches in all (0: until stopped).
        reconnect: open a new call after a lost one (else raise its error).
        retry_window_s: how long reconnecting may go on before giving up: seconds, or
            a function asked once per outage (a server that never answered may get a
            shorter window than one that went away).
        name: for the log (the server's address).
        resumed: called with the first batch of a call that follows a lost one.
        credits_of: the credits a batch used (default one; a link that hands over a
            message's chunks as one view, as a sharded stream's shard does, counts
            them), so that a call reopened after a lost one grants only the room left.
    """

    def __init__(self, link: Link, flow: CreditFlow, *, num_batches: int = 0,
                 reconnect: bool = True,
                 retry_window_s: float | Callable[[], float] = 10.0, name: str = "",
                 resumed: Callable[[], None] | None = None,
                 credits_of: Callable[[SampleBatch], int] | None = None) -> None:
        self.link = link
        self._credits_of = credits_of
        self.flow = flow
        self.num_batches = num_batches
        self.reconnect = reconnect
        self.retry_window_s = retry_window_s
        self.name = name
        self._resumed = resumed
        self._stopped = threading.Event()
        self.received = 0

    def batches(self) -> Iterator[SampleBatch]:
        """Batches across calls, in order, until the stream is complete or stopped.

        Raises:
            Exception: the link's error that ended the stream (after a lost
                connection: its error, or the give-up error past the window).
        """
        backoff: Backoff | None = None
        while not self._stopped.is_set():
            remaining = self.num_batches - self.received if self.num_batches else 0
            if self.num_batches and remaining <= 0:
                return
            opened = self.flow.opening()
            if opened is None or self._stopped.is_set():
                return
            credits, updates = opened
            try:
                for batch in self.link.call(self.flow, credits, updates, remaining,
                                            self.received):
                    if backoff is not None:
                        backoff = None
                        log.info("stream from %s resumed", self.name)
                        if self._resumed is not None:
                            self._resumed()
                    self.received += 1
                    self.flow.arrived(1 if self._credits_of is None
                                      else self._credits_of(batch))
                    yield batch
            except LinkLost as lost:
                if self._stopped.is_set():
                    return
                if not self.reconnect:
                    raise lost.error from None
                if backoff is None:
                    setting = self.retry_window_s
                    window = setting() if callable(setting) else setting
                    backoff = Backoff(window)
                    log.warning("stream from %s lost (%s); reconnecting for up to %g s",
                                self.name, lost.error, window)
                delay = backoff.next_delay()
                if delay is None:
                    raise lost.give_up(window) from None
                self._stopped.wait(delay)
            # A call that ended by itself before the stream had its batches: open the next.

    def stop(self) -> None:
        self._stopped.set()
        self.link.stop()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def complete(self) -> bool:
        """Whether the stream had all its ``num_batches``."""
        return bool(self.num_batches) and self.received >= self.num_batches
