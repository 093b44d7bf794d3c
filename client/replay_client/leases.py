"""The client's side of leases: each sample names its lease, and acknowledges the last one.

On a queue table (capabilities ``consumes``) the server hands a sample's
rows out under a lease named by the request (``SampleRequest.lease``): a
retry of that request (the client retries while the server is unavailable,
e.g. when the answer was lost with the connection) gets the same rows, and
rows never acknowledged return to the queue after the table's
``lease_timeout_s``. A client's sample of a table acknowledges its previous
samples of that table (``SampleRequest.acknowledge``): taking the next batch
says the last one was taken. ``client.ack(table)`` acknowledges them at once
(:meth:`ClientLeases.pending` then :meth:`ClientLeases.acknowledged`).
Other tables ignore both fields (a few dozen bytes a request).

Threads that share one client and sample one queue acknowledge each other's
batches that way; a learner thread that must not lose a batch it has not
finished taking when another thread samples should have its own client.

Names are ``<random 128 bits>-<counter>``: unique per client and process.
Thread-safe.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid


class ClientLeases:
    """Lease names for samples, and the leases not acknowledged yet, per table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._prefix = ""
        self._counter = itertools.count()
        self._pending: dict[str, list[str]] = {}

    def _fresh(self) -> None:
        if self._pid != os.getpid():  # first use, or a forked child: its own names
            self._prefix, self._pid, self._counter = uuid.uuid4().hex, os.getpid(), itertools.count()
            self._pending = {}

    def next(self, table: str) -> tuple[str, list[str]]:
        """A new lease name for a sample of ``table``, and the leases it acknowledges."""
        with self._lock:
            self._fresh()
            return f"{self._prefix}-{next(self._counter)}", list(self._pending.get(table, ()))

    def taken(self, table: str, lease: str, acknowledged: list[str]) -> None:
        """A sample under ``lease`` was received; it acknowledged ``acknowledged``."""
        with self._lock:
            self._fresh()
            left = [n for n in self._pending.get(table, ()) if n not in acknowledged]
            self._pending[table] = [*left, lease]

    def pending(self, table: str) -> list[str]:
        """The leases of ``table`` not acknowledged yet."""
        with self._lock:
            self._fresh()
            return list(self._pending.get(table, ()))

    def acknowledged(self, table: str, names: list[str]) -> None:
        """``names`` were acknowledged (by ``client.ack``)."""
        with self._lock:
            self._fresh()
            self._pending[table] = [n for n in self._pending.get(table, ()) if n not in names]
