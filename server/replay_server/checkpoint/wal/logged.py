"""What every logged object shares: an order lock, a log slot and a log sequence number.

A table (:mod:`~replay_server.checkpoint.wal.logged_table`) and the named
variables (:mod:`~replay_server.checkpoint.wal.logged_variables`) log their
changes the same way, through :class:`LoggedChanges`:

* a change is applied and its record queued under the object's *order lock*,
  so the log holds the object's changes in the order they were applied (the
  order replay repeats); each record carries the object's log sequence
  number :attr:`LoggedChanges.log_seq` (restored with the object from a
  checkpoint, which records the number its snapshot covers);
* the call then waits for the record to be durable *outside* that lock
  (group commit with every other waiting call: :mod:`~replay_server.checkpoint.wal.log`);
* replay applies a record only if its number is the object's next one
  (:meth:`LoggedChanges.replays`).

Thread-safety: :meth:`LoggedChanges.attach` and the change methods may be
called from any thread; the order lock serializes an object's logged changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from replay_server.checkpoint.wal import records
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.errors import CorruptLogError

T = TypeVar("T")

Made = tuple[int, dict[str, Any], dict[str, Any]]
"""A change's record: its kind, its meta and its tensors (what :func:`records.encode` takes)."""


class LoggedChanges:
    """An object whose changes go into the write-ahead log once one is attached.

    Subclasses call :meth:`_start_logging` in their constructor and say what
    identifies them in a record (:meth:`_record_meta`).
    """

    _order: threading.Lock
    _log: WriteAheadLog | None
    log_seq: int
    """The sequence number of the object's next logged change (restored with it)."""

    def _start_logging(self) -> None:
        self._order = threading.Lock()
        self._log = None
        self.log_seq = 0

    def _record_meta(self) -> dict[str, Any]:
        """What names the object in its records (a table's name; the variables')."""
        raise NotImplementedError

    def attach(self, log: WriteAheadLog | None) -> None:
        """Log every change from now on into ``log`` (``None``: stop logging)."""
        with self._order:
            self._log = log

    def _logged(self, log: WriteAheadLog, nbytes: int, change: Callable[[], T],
                record: Callable[[T], Made | None]) -> T:
        """Apply ``change`` and log it: admitted first (``nbytes``, see
        :meth:`WriteAheadLog.admit`), applied and its record (``record(result)``, ``None``:
        nothing to log) queued under the order lock, then waited for outside it."""
        log.admit(nbytes)
        with self._order:
            result = change()
            made = record(result)
            number = None if made is None else self._queue_record(log, *made)
        if number is not None:
            log.wait(number)
        return result

    def _queue_record(self, log: WriteAheadLog, kind: int, meta: dict[str, Any],
                tensors: dict[str, Any]) -> int:
        """Queue the record of a change just applied; under the order lock. It is encoded and
        checksummed by the log's writer thread: the tensors must stay unchanged until then."""
        full = {**self._record_meta(), "seq": self.log_seq, **meta}
        number = log.append(lambda: records.encode(kind, full, tensors))
        self.log_seq += 1
        return number

    def replays(self, seq: object, where: str, what: str) -> bool:
        """Whether a replayed record numbered ``seq`` is this object's next change (apply it,
        then :meth:`replayed_one`); ``False``: the checkpoint already holds it (skip it).

        Raises:
            CorruptLogError: ``seq`` is not a number, or changes before it are missing.
        """
        if not isinstance(seq, int):
            raise CorruptLogError(f"the {where} has no sequence number")
        if seq > self.log_seq:
            raise CorruptLogError(
                f"the {where} is {what}'s change {seq}, but the log lacks its changes "
                f"{self.log_seq}..{seq - 1}: a record or segment is missing")
        return seq == self.log_seq

    def replayed_one(self) -> None:
        """A replayed record was applied: the next one follows it."""
        self.log_seq += 1
