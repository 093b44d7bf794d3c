"""The one retry schedule of clients and streams: exponential backoff with jitter inside a time window.

Every loop that retries an unavailable server (a unary call, a learner's
stream reconnecting) asks a :class:`Backoff` how long to wait next. Delays
start at ``initial_s``, double up to ``max_s``, and are jittered to between
half and one and a half times that (so many clients restarting together do
not retry in step). Once the next wait would end past the window (or the call's own
deadline), :meth:`Backoff.next_delay` answers ``None``: give up.
"""

from __future__ import annotations

import random
import time


class Backoff:
    """One retry schedule, started at construction.

    Args:
        window_s: how long, from now, retries may go on.
        deadline: a ``time.monotonic()`` no wait may reach (a call's own
            timeout); ``None``: only the window counts.
        initial_s: the first delay (before jitter).
        max_s: the largest delay (before jitter).

    Not thread-safe: one per retry loop.
    """

    def __init__(self, window_s: float, *, deadline: float | None = None,
                 initial_s: float = 0.05, max_s: float = 1.0) -> None:
        self.window_s = window_s
        self._until = time.monotonic() + window_s
        self._deadline = deadline
        self._delay = initial_s
        self._max = max_s

    def next_delay(self) -> float | None:
        """Seconds to wait before the next try, or ``None`` when no try is left."""
        now = time.monotonic()
        delay = self._delay
        if now + delay > self._until or (self._deadline is not None and now + delay >= self._deadline):
            return None
        self._delay = min(delay * 2, self._max)
        return delay * (0.5 + random.random())
