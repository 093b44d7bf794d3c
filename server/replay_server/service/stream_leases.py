"""A SampleStream's leases: a queue's rows stay the stream's until its learner finished them.

On a table whose sampler consumes its rows (``fifo``/``lifo``), a learner
that names a lease prefix in its first message (``SampleStreamRequest.lease``)
gets every group of batches drawn together under one lease of the table,
``<prefix>/<nonce>/<index>`` (``index``: the stream's index of the group's first
batch; :mod:`replay_server.engine.leases`). The nonce is a secret of the call (128
random bits), so a stream's leases are its own: another stream naming the same prefix,
a unary ``Sample`` or an ``Acknowledge`` naming ``<prefix>/<index>`` cannot take, be
handed or acknowledge them. The learner's later messages say
how many batches it *finished* since its previous one (``finished``, riding
on its credits as priority updates do); batches finish in the order they
were sent, so the groups are acknowledged in order, each once all its
batches are finished. Acknowledgements are applied in the engine pool
before the stream's next draw (no extra lock on the event loop), and when
the stream ends.

When the stream ends, however it ends (the learner half-closes or cancels,
its process dies and the connection drops, a deadline, the server stops),
:meth:`StreamLeases.end` gives back every group not acknowledged: the rows
of batches not finished return to their place in the queue (the front, for
``fifo``; the table's ``returned`` counter counts them), and those the
learner finished in a group it did not finish whole are acknowledged. So a
live learner gets each row once, and rows a dead one had prefetched or was
working on are handed to the next learner (at least once).

A stream's leases do not expire while it is open (the learner may hold a
batch as long as it likes); a draw that completes after the stream ended
(it was running in the engine pool when the call was cancelled) gives its
lease back at once (:meth:`StreamLeases.drawn`).

Memory: one entry per group in flight (at most the learner's window).
Thread-safety: :meth:`drawn` and :meth:`settle` run in the engine pool,
:meth:`finish` on the event loop; a lock keeps the books consistent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from replay_server.engine import MAX_LEASE_NAME, LeaseRequest, Table
from replay_server.errors import InvalidArgumentError
from replay_server.service.stream_requests import messages_until

log = logging.getLogger("replay_server.service")

NONCE_HEX = 32
"""Hex digits of the secret each stream call adds to its lease names (128 bits)."""

MAX_PREFIX = MAX_LEASE_NAME - 56 - NONCE_HEX - 1
"""Longest lease prefix a stream may name (room for ``/<nonce>/<index>``)."""


class StreamLeases:
    """The leases one SampleStream call holds on its queue table (see the module docstring).

    Args:
        table: the stream's table (its sampler consumes its rows).
        prefix: the learner's lease prefix (1-:data:`MAX_PREFIX` characters).
        batch_size: draws per batch (rows, or slices).

    Raises:
        InvalidArgumentError: a prefix that is too long.
    """

    def __init__(self, table: Table, prefix: str, batch_size: int) -> None:
        if not 0 < len(prefix) <= MAX_PREFIX:
            raise InvalidArgumentError(
                f"a SampleStream lease prefix must be 1-{MAX_PREFIX} characters, got "
                f"{len(prefix)}")
        self._table = table
        # The call's own leases, whatever prefix it named: no other call (a stream naming
        # the same prefix, a unary Sample or an Acknowledge naming '<prefix>/0') can take,
        # be handed or acknowledge them, since none can know this secret.
        self._prefix = f"{prefix}/{secrets.token_hex(NONCE_HEX // 2)}"
        self._batch_size = batch_size
        self._lock = threading.Lock()
        self._groups: deque[tuple[str, int]] = deque()  # (lease name, batches), draw order
        self._drawn = 0        # batches drawn under a lease so far
        self._finished = 0     # batches the learner finished, not yet in an acknowledged group
        self._reported = 0     # batches the learner said it finished, in all
        self._ready: list[str] = []  # groups finished whole, to acknowledge in the engine pool
        self._ended = False

    @staticmethod
    def open(table: Table, prefix: str, batch_size: int) -> StreamLeases | None:
        """The stream's leases, or ``None``: no prefix, or a table whose rows stay when
        sampled (nothing to lease)."""
        if not prefix or not table.config.sampler.traits.consumes:
            return None
        return StreamLeases(table, prefix, batch_size)

    def request(self, index: int) -> LeaseRequest:
        """The lease the group starting at batch ``index`` is drawn under (never expires)."""
        return LeaseRequest(f"{self._prefix}/{index}", math.inf)

    def drawn(self, lease: LeaseRequest, batches: int) -> None:
        """Engine pool, right after a group was drawn under ``lease``: keep it, or give it
        back at once if the stream ended meanwhile."""
        with self._lock:
            if not self._ended:
                self._groups.append((lease.name, batches))
                self._drawn += batches
                return
        self._table.settle_leases(give_back=[lease.name])

    def finish(self, batches: int) -> None:
        """Event loop: the learner finished ``batches`` more batches (in order).

        Raises:
            InvalidArgumentError: a negative count, or more batches than were sent.
        """
        if batches == 0:
            return
        with self._lock:
            if batches < 0 or self._reported + batches > self._drawn:
                raise InvalidArgumentError(
                    f"a SampleStream message said {batches} more batch(es) finished, "
                    f"{self._reported} before, but {self._drawn} were drawn")
            self._reported += batches
            self._finished += batches
            while self._groups and self._groups[0][1] <= self._finished:
                name, count = self._groups.popleft()
                self._finished -= count
                self._ready.append(name)

    @property
    def all_finished(self) -> bool:
        """Whether every batch drawn so far was finished (nothing would come back now)."""
        with self._lock:
            return self._reported == self._drawn

    def settle(self) -> None:
        """Engine pool: acknowledge the groups finished whole since the last call."""
        with self._lock:
            ready, self._ready = self._ready, []
        if ready:
            self._table.settle_leases(acknowledge=ready)

    def end(self) -> int:
        """Engine pool, once the stream ended: acknowledge what was finished, give back the
        rest; the rows that came back. Later draws give their leases back themselves."""
        with self._lock:
            self._ended = True
            ready, self._ready = self._ready, []
            groups, self._groups = [name for name, _ in self._groups], deque()
            part = self._finished
        if not ready and not groups:
            return 0
        # The first `part` batches of the front group were finished: those rows stay taken.
        first = (groups[0], part * self._batch_size) if groups and part else None
        return self._table.settle_leases(acknowledge=ready, acknowledge_first=first,
                                         give_back=groups)

    async def wait_finished(self, event: asyncio.Event, timeout_s: float,
                            over: Callable[[], bool]) -> None:
        """Event loop, once the last batch was sent: wait until the learner finished every
        batch (``event`` is set on each of its messages), or ``over()`` (it left, the server
        drains), at most ``timeout_s`` (the table's ``lease_timeout_s``), so that its
        acknowledgements arrive before :meth:`end` gives back what is left."""
        await messages_until(event, timeout_s, lambda: self.all_finished or over())

    def end_soon(self, executor: Executor) -> None:
        """Event loop, as the stream ends: :meth:`end` in the engine pool, not awaited (the
        call may be cancelled; a draw still running gives its own lease back); here if the
        pool is shut down (the server stopped)."""
        table = self._table.name
        try:
            future = asyncio.get_running_loop().run_in_executor(executor, self.end)
        except RuntimeError:
            _log_returned(table, self.end)
            return
        future.add_done_callback(lambda done: _log_returned(table, done.result))


def _log_returned(table: str, end: Callable[[], int]) -> None:
    """Run ``end`` (a stream's leases ending, or its result); log the rows that came back."""
    try:
        back = end()
    except Exception:  # pragma: no cover - a bug: say so, the server goes on
        log.exception("SampleStream of table %r: giving back its leases failed", table)
        return
    if back:
        log.info("SampleStream of table %r ended: %d unfinished row(s) back in the queue",
                 table, back)
