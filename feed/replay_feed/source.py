"""``LinkSource``: the one feed source of every stream, a :class:`~replay_feed.link.Link` run by the skeleton.

The gRPC stream, the shared-memory stream, the in-process stream and the
sharded stream differ only in their link; this source runs any of them on
the feed's background thread with the learner's credits
(:meth:`~replay_feed.core.FeedCore.flow`), hands each batch to the feed in
order, and takes the learner's priority updates into the credit queue so
that they travel with the next credit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from replay_feed.core import FeedCore
from replay_feed.credits import PriorityUpdate
from replay_feed.link import Link, LinkRunner

CheckUpdate = Callable[[Any, Any], PriorityUpdate]
"""``check(ids, priorities)``: the update as flat arrays, or the entry's typed error."""

SETTLE_S = 2.0
"""How long closing a stream that had all its batches waits for the updates the learner made
last to be delivered (:meth:`~replay_feed.link.Link.after_last`) before it stops the link."""


class LinkSource:
    """A feed source over ``link`` (see the module docstring).

    Args:
        link: the transport.
        check_update: validates a learner's priority update (raising the
            entry's own typed error); ``None``: the stream takes none.
        num_batches: batches in all (0: until the learner stops).
        reconnect: reopen a lost call (with backoff, within ``retry_window_s``).
        retry_window_s: how long reconnecting may go on (seconds, or a function asked
            once per outage; see :class:`~replay_feed.link.LinkRunner`).
        name: for the log (where batches come from).
    """

    def __init__(self, link: Link, *, check_update: CheckUpdate | None = None,
                 num_batches: int = 0, reconnect: bool = True,
                 retry_window_s: float | Callable[[], float] = 10.0, name: str = "") -> None:
        self.link = link
        self._check = check_update
        self._num_batches = num_batches
        self._reconnect = reconnect
        self._window_s = retry_window_s
        self._name = name
        self._runner: LinkRunner | None = None
        self._stopped = False
        self._settled = threading.Event()  # run() is past delivering the last updates

    @property
    def leased(self) -> bool:
        """Whether the link's batches are leased (a queue table's: a batch not finished
        when the stream ends goes back to the queue); false for a link that does not say."""
        return bool(getattr(self.link, "leased", False))

    def run(self, core: FeedCore) -> None:
        core.stats.transport = self.link.transport

        def resumed() -> None:
            core.stats.reconnects += 1

        flow = core.flow()
        runner = LinkRunner(self.link, flow, num_batches=self._num_batches,
                            reconnect=self._reconnect, retry_window_s=self._window_s,
                            name=self._name, resumed=resumed)
        self._runner = runner
        try:
            if self._stopped:
                return
            for index, batch in enumerate(runner.batches()):
                core.stats.transport = self.link.transport
                core.deliver(index, batch)
            if runner.complete:
                # Every batch is out; the learner may hold a window of them still. It sees
                # the end once it took them, and their updates go on until it closes.
                core.finish()
                self.link.after_last(flow)
        finally:
            self._settled.set()
            self.link.close()

    def stop(self) -> None:
        """Stop the link; on a stream that had all its batches, once the updates the learner
        made last were delivered (at most :data:`SETTLE_S`: the feed has stopped its credits
        before, which ends :meth:`~replay_feed.link.Link.after_last`)."""
        self._stopped = True
        runner = self._runner
        if runner is not None and runner.complete:
            self._settled.wait(SETTLE_S)
        if runner is not None:
            runner.stop()
        else:
            self.link.stop()

    def check_update(self, ids: Any, priorities: Any) -> PriorityUpdate:
        """A learner's priority update as flat arrays, checked.

        Raises:
            NotImplementedError: this stream takes no updates.
            Exception: the entry's typed error for bad ids or priorities.
        """
        if self._check is None:
            raise NotImplementedError("this stream does not take priority updates")
        return self._check(ids, priorities)
