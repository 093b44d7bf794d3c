"""Asynchronous priority updates: ``update_priorities(..., wait=False)``.

A learner should never wait on the network to set priorities. Updates given
with ``wait=False`` are queued and sent by one background thread, in order.
While a call is in flight, later updates pile up and go out together as one
call per table: the server applies a batch of ids in order with the last
priority of a repeated id winning, which is exactly what applying the updates
one after another would do, so merging changes nothing but the number of
round trips (each costs about 0.6 ms with Python gRPC). A merged call holds at
most ``max_ids_per_call`` ids (the client's message limit, see
:mod:`replay_client.update_parts`): more go out as further calls, in order,
and an update larger than that on its own is sent in parts, so no update is
ever refused for its size.

A failed call (say, an id the table never issued) is raised, as
:class:`~replay_client.errors.PriorityUpdateError` with the cause attached,
by the next ``update_priorities`` or ``flush_updates``; the ids of that call
were not applied and the error says how many (later calls go on).

Thread-safety: submit and flush from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from replay_client.errors import DeadlineExceededError, PriorityUpdateError

Send = Callable[[str, np.ndarray, np.ndarray], int]
"""Sends one update request ``(table, ids, priorities)`` and returns how many ids it applied."""

Parts = Callable[[str, np.ndarray, np.ndarray], Iterable[tuple[np.ndarray, np.ndarray]]]
"""Splits ``(table, ids, priorities)`` into requests that each fit one message, in order."""


class PriorityUpdater:
    """Ordered, coalescing background sender of priority updates.

    Args:
        send: performs one update call ``(table, ids, priorities) -> applied``.
        max_pending_ids: ids queued before ``submit`` blocks (bounded memory).
        max_ids_per_call: queued updates are merged up to this many ids per
            call (``None``: no bound); one update alone may be larger.
        parts: splits each call into requests that fit one message (``None``:
            sent as it is); it may raise (then that call's ids were not applied).
    """

    def __init__(self, send: Send, max_pending_ids: int = 1 << 20, *,
                 max_ids_per_call: int | None = None, parts: Parts | None = None) -> None:
        self._send = send
        self._max_pending = max_pending_ids
        self._max_ids = max_ids_per_call
        self._parts = parts or (lambda table, ids, priorities: ((ids, priorities),))
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._pending = 0        # ids queued or in flight
        self._error: BaseException | None = None
        self._lost = 0
        self._stopped = False
        self.applied = 0         # ids the server applied (present rows)
        self._thread = threading.Thread(target=self._run, name="priority-updates", daemon=True)
        self._thread.start()

    def submit(self, table: str, ids: np.ndarray, priorities: np.ndarray) -> None:
        """Queue an update (arrays the caller will not modify); may block on backpressure."""
        with self._cond:
            self._raise_error()
            while self._pending >= self._max_pending and self._error is None:
                self._cond.wait()
            self._raise_error()
            self._queue.append((table, ids, priorities))
            self._pending += ids.size
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued update was sent and answered.

        Raises:
            PriorityUpdateError: a background update failed.
            DeadlineExceededError: not done within ``timeout`` seconds (a ``TimeoutError``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceededError(
                        f"flush timed out with {self._pending} priority updates still pending")
                self._cond.wait(remaining)
            self._raise_error()

    def close(self) -> None:
        """Stop the background thread (after what is queued was sent)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, lost = self._error, self._lost
            self._error, self._lost = None, 0  # reported once; later updates go on
            raise PriorityUpdateError(
                f"a background priority update failed; {lost} ids were not applied "
                f"({type(error).__name__}: {error})"
            ) from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            for table, ids, priorities in _merge(batch, self._max_ids):
                self._send_call(table, ids, priorities)

    def _send_call(self, table: str, ids: np.ndarray, priorities: np.ndarray) -> None:
        """One merged call, as requests that fit a message; each settles its ids."""
        try:
            parts = list(self._parts(table, ids, priorities))
        except BaseException as exc:  # surfaced by the next call, never swallowed
            self._settle(ids.size, None, exc)
            return
        for part_ids, part_priorities in parts:
            try:
                self._settle(part_ids.size, self._send(table, part_ids, part_priorities), None)
            except BaseException as exc:  # surfaced by the next call, never swallowed
                self._settle(part_ids.size, None, exc)

    def _settle(self, count: int, applied: int | None, error: BaseException | None) -> None:
        """``count`` ids are no longer pending: applied (``applied`` of them present) or lost."""
        with self._cond:
            self._pending -= count
            if applied is None:
                self._error = self._error or error
                self._lost += count
            else:
                self.applied += applied
            self._cond.notify_all()


def _merge(batch: list[tuple[str, np.ndarray, np.ndarray]], max_ids: int | None):
    """Consecutive updates of the same table as one, up to ``max_ids`` ids (order kept;
    an update is never cut here, so one alone may be larger)."""
    start = 0
    while start < len(batch):
        table = batch[start][0]
        stop, size = start + 1, batch[start][1].size
        while (stop < len(batch) and batch[stop][0] == table
               and (max_ids is None or size + batch[stop][1].size <= max_ids)):
            size += batch[stop][1].size
            stop += 1
        run = batch[start:stop]
        if len(run) == 1:
            yield run[0]
        elif len({r[1].shape[1:] for r in run}) == 1 and run[0][1].ndim > 1:  # rows of slices
            yield table, np.concatenate([r[1] for r in run]), np.concatenate([r[2] for r in run])
        else:
            yield (table, np.concatenate([r[1].reshape(-1) for r in run]),
                   np.concatenate([r[2].reshape(-1) for r in run]))
        start = stop
