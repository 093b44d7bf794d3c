"""Calls held back by a table's rate limiter wait here, on the event loop, holding no thread.

The engine never blocks: a table whose rate limiter (or ``max_times_sampled``)
holds an insert or a sample back raises
:class:`~replay_server.errors.RateLimitedError` at once, having changed
nothing. :meth:`BlockedCalls.run` catches that and waits for the table to
change (the servicer reports every insert, sample, priority update and reset
through :meth:`BlockedCalls.changed`; a restore reports ``changed()`` for all
tables), then tries again in the engine's thread pool. So a thousand blocked
samplers cost a thousand small coroutines, not a thousand threads, and never
starve the inserts that would unblock them.

No wake-up is lost: every attempt notes the change clock before it starts,
and a change reported after that clock makes the waiter try again. Before
retrying, a waiter asks the limiter (read without the table's lock: only a
hint, the retry decides) whether the call would pass, so a change that cannot
help wakes it without engine work.

Deadlines: a call waits until shortly before its gRPC deadline (a tenth of
the time it had left when it first blocked, at most 0.2 s, so the reason
reaches the client before the client's own deadline fires), then fails with
the limiter's last message plus "until the deadline", which the status
mapping turns into DEADLINE_EXCEEDED. A call with no deadline waits until the
client cancels it. While the server drains, waiters give up with
:class:`~replay_server.service.status.ShuttingDownError` (UNAVAILABLE).

Waiting for data: a sample that asks to wait (``wait_for_data``) while its
table is empty is held back the same way: :func:`draw` turns the engine's
:class:`~replay_server.errors.EmptyTableError` into a ``RateLimitedError``,
so the call waits for an insert (or a restore) without a thread and without
polling, until its deadline.

Thread-safety: event-loop only (the attempt itself runs in the pool).
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from replay_proto.batch import SampleBatch
from replay_server.engine import LeaseRequest, Table, host_batch
from replay_server.errors import EmptyTableError, RateLimitedError
from replay_server.service.status import ShuttingDownError

T = TypeVar("T")

GIVE_UP_EARLY_MAX_S = 0.2
"""A blocked call gives up at most this long before its deadline."""

GIVE_UP_EARLY_FRACTION = 0.1
"""... and at most this fraction of the time it had left when it first blocked."""

Hint = Callable[[str, str, int], bool]
"""``hint(table, operation, count)``: might the call pass now? (True when unsure)."""


@dataclass(frozen=True, slots=True)
class BlockedTotals:
    """What :meth:`BlockedCalls.totals` reports, each keyed by ``(table, operation)``.

    ``calls``: calls ever held back (counted once each, however often they
    waited); ``seconds``: time spent waiting, added as each wait ends;
    ``waiting``: calls waiting now.
    """

    calls: dict[tuple[str, str], int]
    seconds: dict[tuple[str, str], float]
    waiting: dict[tuple[str, str], int]


class BlockedCalls:
    """Where rate-limited calls wait for their table to change.

    Args:
        hint: cheap, lock-free guess whether a blocked call would pass now.
    """

    def __init__(self, hint: Hint) -> None:
        self._hint = hint
        self._clock = 0
        self._changed_at: dict[str, int] = {}
        self._all_changed_at = 0
        self._wakeups: dict[str, asyncio.Event] = {}
        self._waiting: Counter[tuple[str, str]] = Counter()
        self._blocked_calls: Counter[tuple[str, str]] = Counter()
        self._blocked_seconds: defaultdict[tuple[str, str], float] = defaultdict(float)

    def changed(self, table: str | None = None) -> None:
        """``table`` (``None``: every table) changed: wake the calls waiting on it."""
        self._clock += 1
        if table is None:
            self._all_changed_at = self._clock
            wakeups, self._wakeups = list(self._wakeups.values()), {}
        else:
            self._changed_at[table] = self._clock
            wakeup = self._wakeups.pop(table, None)
            wakeups = [] if wakeup is None else [wakeup]
        for wakeup in wakeups:
            wakeup.set()

    def waiting(self, table: str, operation: str) -> int:
        """Calls of ``operation`` (``"insert"``/``"sample"``) waiting on ``table`` now."""
        return self._waiting[(table, operation)]

    def totals(self) -> BlockedTotals:
        """Calls held back so far, seconds they waited, and calls waiting now, per
        ``(table, operation)``. Copies, safe to take from another thread (metrics scrapes)."""
        return BlockedTotals(calls=dict(self._blocked_calls),
                             seconds=dict(self._blocked_seconds), waiting=dict(self._waiting))

    async def run(
        self,
        attempt: Callable[[], Awaitable[T]],
        *,
        time_remaining: Callable[[], float | None],
        stopping: Callable[[], bool],
        on_block: Callable[[], None] | None = None,
    ) -> T:
        """``await attempt()`` until it does not raise RateLimitedError, waiting in between.

        Args:
            attempt: starts the engine call (in the thread pool) and returns its future.
            time_remaining: seconds to the call's deadline (``None``: no deadline).
            stopping: whether the server is draining.
            on_block: called once, when the call is first held back, before it waits
                (what it raises ends the call: the admission refusing a waiter).

        Raises:
            RateLimitedError: still held back shortly before the deadline.
            ShuttingDownError: the server started draining while the call waited.
            Exception: whatever else the attempt (or ``on_block``) raises.
        """
        loop = asyncio.get_running_loop()
        give_up_at: float | None = None
        first = True
        while True:
            since = self._clock
            try:
                return await attempt()
            except RateLimitedError as exc:
                blocked = exc
            if first:
                first = False
                if on_block is not None:
                    on_block()
                self._blocked_calls[(blocked.table, blocked.operation)] += 1
                remaining = time_remaining()
                if remaining is not None:
                    early = min(GIVE_UP_EARLY_MAX_S, GIVE_UP_EARLY_FRACTION * remaining)
                    give_up_at = loop.time() + remaining - early
            await self._wait(blocked, since, give_up_at, stopping)

    async def _wait(
        self,
        blocked: RateLimitedError,
        since: int,
        give_up_at: float | None,
        stopping: Callable[[], bool],
    ) -> None:
        """Return once ``blocked``'s table changed after ``since`` in a way that may let it pass."""
        loop = asyncio.get_running_loop()
        table, key = blocked.table, (blocked.table, blocked.operation)
        self._waiting[key] += 1
        started = loop.time()
        try:
            while True:
                if stopping():
                    raise ShuttingDownError("the server is shutting down")
                if max(self._changed_at.get(table, 0), self._all_changed_at) > since:
                    if self._hint(table, blocked.operation, blocked.count):
                        return
                    since = self._clock
                timeout = None if give_up_at is None else give_up_at - loop.time()
                if timeout is not None and timeout <= 0:
                    raise RateLimitedError(
                        f"{blocked} until the deadline", table=table,
                        operation=blocked.operation, count=blocked.count,
                    )
                wakeup = self._wakeups.setdefault(table, asyncio.Event())
                try:
                    await asyncio.wait_for(wakeup.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            self._blocked_seconds[key] += loop.time() - started
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]


def draw(table: Table, batch_size: int, *, wait_for_data: bool,
         out: Mapping[str, torch.Tensor] | None = None, never_wait: bool = False,
         lease: LeaseRequest | None = None) -> SampleBatch:
    """``table.sample(batch_size, out=out, lease=lease)``; with ``wait_for_data``, an empty
    table blocks.

    The batch is on the host: a device table's is copied over once (the
    fallback of every network path; see :func:`host_batch`), unless ``out`` is
    device memory (a CUDA IPC slot): then its columns are ``out``, its ids,
    weights and probabilities on the host.

    Raises:
        RateLimitedError: held back by the rate limiter, or (``wait_for_data``)
            the table has nothing to sample yet; :meth:`BlockedCalls.run` waits.
        EmptyTableError: the table is empty and the caller did not ask to wait,
            or (``never_wait``) it cannot serve the batch now for any reason.
    """
    try:
        batch = table.sample(batch_size, out=out, lease=lease)
        if out is not None and any(t.device.type != "cpu" for t in out.values()):
            return batch  # gathered into device memory the caller lent (a CUDA IPC slot)
        return host_batch(batch)
    except RateLimitedError as exc:
        if not never_wait:
            raise
        raise EmptyTableError(f"{exc}; the call asked not to wait (wait=False)") from None
    except EmptyTableError as exc:
        if never_wait:
            raise
        if not wait_for_data:
            raise
        raise RateLimitedError(
            f"{exc}; waited for data", table=table.name, operation="sample",
            count=batch_size * (table.config.slice_len or 1)) from None
