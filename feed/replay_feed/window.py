"""How far ahead a stream runs: a window that grows until the link, not the round trip, limits it.

A stream keeps ``window`` batches in flight or buffered ahead of the learner.
On loopback two are enough; across a network a batch granted now arrives a
round trip (plus its draw and transfer) later, so a window of ``w`` batches
delivers at most ``w`` batches per round trip however fast the link is: at
5 ms each way and a few milliseconds per batch, two batches leave the link
idle most of the time. The window a link needs is its bandwidth times its
delay (in batches), which neither side knows in advance.

:class:`WindowGrowth` finds it by watching the learner: while the learner
keeps waiting for batches, the window is widened (by half, at least one
batch), as long as the last widening made batches come faster; once a
widening brought no gain, the link (or the server, or the learner) is what
limits the stream, and the window stays. It never grows past the learner's
memory budget (``memory_mb``: window and staging together), nor past
:data:`MAX_WINDOW`, and never shrinks. A ``prefetch`` the learner gave is
kept as it is, and a shared-memory ring's window cannot grow (its slots are
fixed when it is created). ``stream.stats.notes`` says how far it grew.

Cost: O(1) per batch taken, on the learner's thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from replay_feed.credits import CreditFlow

MAX_WINDOW = 512
"""The largest window a stream grows to, whatever the budget."""

SAMPLE = 8
"""Batches taken between two decisions, at least."""

SAMPLE_S = 0.1
"""Seconds between two decisions, at least (a widening needs a round trip to show)."""

WAITED_S = 0.0005
"""A ``next()`` that waited longer than this found no batch ready: the learner starved."""

GAIN = 1.05
"""A widening must make batches come at least this much faster to be followed by another."""


class WindowGrowth:
    """Widens ``flow``'s window while the learner starves and widening helps (module docstring).

    Args:
        flow: the learner's credits (its window grows).
        budget_bytes: what the window and the staging may take together.
        batch_bytes: one batch's size now (``None``: not known yet).
        may_grow: whether the transport in use can take a wider window now.
        note: records what was decided (``stream.stats.notes``).
    """

    def __init__(self, flow: CreditFlow, budget_bytes: float,
                 batch_bytes: Callable[[], float | None], may_grow: Callable[[], bool],
                 note: Callable[[str], None]) -> None:
        self._flow = flow
        self._budget = budget_bytes
        self._batch_bytes = batch_bytes
        self._may_grow = may_grow
        self._note = note
        self._since = time.perf_counter()
        self._starved = 0
        self._seen = 0
        self._last_rate: float | None = None
        self._settled = False

    def took(self, waited_s: float) -> None:
        """The learner took a batch after waiting ``waited_s``."""
        if self._settled:
            return
        now = time.perf_counter()
        self._seen += 1
        self._starved += waited_s > WAITED_S
        if self._seen < SAMPLE or now - self._since < SAMPLE_S:
            return
        seen, starved, since = self._seen, self._starved, self._since
        self._seen, self._starved, self._since = 0, 0, now
        rate = seen / max(1e-9, now - since)
        if self._last_rate is not None and rate < self._last_rate * GAIN:
            self._settle(f"window {self._flow.window}: wider brought no faster batches")
            return
        self._last_rate = rate
        if starved * 2 < seen or not self._may_grow():
            self._last_rate = None  # not starving (or not now): judge a later widening afresh
            return
        window = self._flow.window
        wanted = min(window + max(1, window // 2), self.limit())
        if wanted <= window:
            self._settle(f"window {window}: the memory budget's limit")
            return
        self._flow.grow(wanted - window)

    def limit(self) -> int:
        """The widest window the budget allows (batches held plus one being read)."""
        nbytes = self._batch_bytes()
        if not nbytes:
            return self._flow.window
        return max(self._flow.window, min(MAX_WINDOW, math.floor(self._budget / nbytes) - 1))

    def _settle(self, why: str) -> None:
        self._settled = True
        self._note(f"{why} (grown by itself over a slow link; docs/learner.md)")
