"""A count of a table's changes that threads can wait on.

An in-process learner whose sample the rate limiter holds back must wait
until the table changes (an insert, a delete) rather than poll it.
:class:`ChangeClock` is that wait: the table ticks it once per change, under
its own lock; a waiter takes a :meth:`~ChangeClock.mark`, checks whatever
would make it stop, tries, and if it must wait, waits for the clock to move
past its mark. :meth:`~ChangeClock.wake` moves the mark without a change, so
a waiter that is being stopped returns (its stop flag is set before the
wake, and it checks the flag after taking its mark: no wake-up is lost). A
tick nobody waits for costs an integer increment and one read.

Thread-safety: :meth:`tick` is called by one writer at a time (the table,
under its lock); :meth:`wait` and :meth:`wake` from any thread.
"""

from __future__ import annotations

import threading


class ChangeClock:
    """Counts changes; :meth:`wait` blocks until the count passes a value."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._waiters = 0
        self._wakes = 0
        self.now = 0

    @property
    def waiters(self) -> int:
        """Threads waiting in :meth:`wait` now."""
        return self._waiters

    def tick(self) -> None:
        """Record one change and wake every waiter."""
        self.now += 1
        if self._waiters:  # a waiter counts itself before it checks `now`: no lost wake-up
            with self._cond:
                self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter without a change (e.g. so a stopping stream notices)."""
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()

    def mark(self) -> tuple[int, int]:
        """Where the clock stands now: what :meth:`wait` waits to move past."""
        return self.now, self._wakes

    def wait(self, mark: tuple[int, int], timeout: float | None = None) -> bool:
        """Block until a change or a :meth:`wake` after ``mark``, or ``timeout`` seconds.

        Returns:
            True when woken (a change or a wake-up), False when ``timeout`` passed.
        """
        with self._cond:
            self._waiters += 1
            try:
                return self._cond.wait_for(lambda: (self.now, self._wakes) != mark, timeout)
            finally:
                self._waiters -= 1
