"""Inserts sent in the background, in order: an RLlib ``add`` that waits for no round trip.

RLlib's training step calls the buffer's ``add`` with the env runners'
episodes, then samples and trains. :class:`PendingAdds` hands each insert to
one background thread and returns, so the insert's round trip to the shards
overlaps the learner's update instead of adding to the step. At most
``most`` inserts are on their way; the next ``put`` waits for the oldest
(bounded memory: backpressure when the shards fall behind).

Errors: an insert that fails is raised by the next :meth:`PendingAdds.put`
or :meth:`PendingAdds.wait` as :class:`~replay_client._WriterError`
naming the rows not stored, the cause attached; the inserts queued after it
are not sent (nothing is stored out of order), and every later call raises
the same error. Checks that need no server (episode types, observation
dtypes) are made by the caller before :meth:`put`, so bad input is still
refused by the ``add`` that brought it.

Thread-safety: one caller (the algorithm's training step) at a time; the
client is shared with the background thread (clients are thread-safe).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import replay_client

_STOP = object()
_WriterError = replay_client.errors.WriterError  # through the client's front door


class PendingAdds:
    """Ordered background inserts into ``table`` through ``client`` (see the module docstring).

    Args:
        client: a ``ReplayClient`` (one server or sharded).
        table: the table the rows go to.
        most: inserts on their way at most (>= 1).
        source: what sends the inserts, as the error names it (``"an RLlib add"``, ``"env
            runner 2's sample"``).
    """

    def __init__(self, client: Any, table: str, most: int, *,
                 source: str = "an RLlib add") -> None:
        self._client, self._table, self._source = client, table, source
        self._queue: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(most)
        self._idle = threading.Condition()
        self._pending = 0
        self._error: _WriterError | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def put(self, rows: dict[str, Any], priorities: Any, count: int) -> None:
        """Queue the insert of ``rows`` (``count`` of them); waits while ``most`` are on
        their way.

        Raises:
            WriterError: an earlier insert failed (nothing more was sent after it), or
                :meth:`stop` was called.
        """
        self.check()
        if self._stopped:
            raise _WriterError(f"table {self._table!r}: the buffer was closed; nothing was sent")
        self._slots.acquire()
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="replay-rllib-adds",
                                            daemon=True)
            self._thread.start()
        self._queue.put((rows, priorities, count))

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued insert was stored.

        Raises:
            WriterError: one failed (or ``timeout`` passed with some still on their way).
        """
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0 or self._error is not None,
                                       timeout):
                raise _WriterError(f"table {self._table!r}: {self._pending} inserts still on "
                                  f"their way after {timeout:g} s")
        self.check()

    def stop(self) -> None:
        """End the thread once the inserts queued now are sent (waits for nothing: call
        :meth:`wait` first to know they were stored)."""
        self._stopped = True
        if self._thread is not None:
            self._queue.put(_STOP)

    def check(self) -> None:
        """Raise the first insert that failed, if one did (waits for nothing).

        Raises:
            WriterError: an insert failed (see the module docstring).
        """
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            rows, priorities, count = item
            try:
                if self._error is None:  # after a failure nothing is sent out of order
                    self._client.insert(self._table, rows, priorities=priorities)
            except Exception as exc:
                error = _WriterError(f"table {self._table!r}: a background insert of {count} "
                                    f"rows ({self._source}) failed; it and the adds queued after "
                                    f"it were not stored: {exc}")
                error.__cause__ = exc
                self._error = error
            finally:
                self._slots.release()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
