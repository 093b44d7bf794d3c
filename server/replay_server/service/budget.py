"""The process' memory budget for calls: bytes reserved before they are held.

Every call reserves, from one :class:`MemoryBudget`, the bytes it is about
to hold, *before* it holds them: the request before it is read (its declared
size, else the message limit), a sampled batch before it is drawn (the batch
and its encoding), a stream's group of batches before it is drawn. A
reservation is released when the bytes are gone: a unary call's when gRPC
has handed its whole response to the socket (a slow reader keeps it
reserved), a stream group's when its last chunk was sent.

A reservation that does not fit *now* is refused with
:class:`~replay_server.service.status.OverloadedError` (RESOURCE_EXHAUSTED,
kind ``overloaded``: nothing ran, try again later); one that could never fit
with :class:`~replay_server.service.status.LimitExceededError` (kind
``limit_exceeded``). Streams wait for room instead (:meth:`MemoryBudget.wait`).

Small calls are never crowded out by large ones: reservations above
:data:`SMALL_BYTES` together take at most :data:`BULK_SHARE` of the budget,
so the rest always serves small samples, updates and inserts.

Thread-safety: reservations are made and released from any thread (the
event loop, the engine's pool); :meth:`MemoryBudget.wait` runs on the event loop.
"""

from __future__ import annotations

import asyncio
import threading

from replay_server.engine.memory import format_bytes
from replay_server.service.status import LimitExceededError, OverloadedError

SMALL_BYTES = 1 << 20
"""Reservations up to this size may use the whole budget."""

BULK_SHARE = 0.75
"""Share of the budget larger reservations may take together."""


class MemoryBudget:
    """Bytes calls may hold at once (see the module docstring).

    Args:
        limit: the budget in bytes.
        what: how the limit is named in refusals (the config key).
        bulk_share: share of the budget reservations above :data:`SMALL_BYTES`
            may take together.

    Attributes:
        in_use: bytes reserved now.
        peak: the most bytes reserved at once so far.
        refused: reservations refused so far.
    """

    def __init__(self, limit: int, what: str = "server.memory_budget_mb",
                 bulk_share: float = BULK_SHARE) -> None:
        self.limit = limit
        self.what = what
        self.bulk_limit = int(limit * bulk_share)
        self.in_use = 0
        self.bulk_in_use = 0
        self.peak = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def reserve(self, nbytes: int, purpose: str) -> Reservation:
        """Reserve ``nbytes`` for ``purpose`` now, or refuse.

        Raises:
            LimitExceededError: ``nbytes`` could never fit.
            OverloadedError: it does not fit now.
        """
        reservation = Reservation(self)
        reservation.resize(nbytes, purpose)
        return reservation

    async def wait(self, nbytes: int, purpose: str,
                   reservation: Reservation | None = None) -> Reservation:
        """Reserve ``nbytes`` (or grow ``reservation`` to them), waiting (on the event loop)
        until they fit.

        Raises:
            LimitExceededError: ``nbytes`` could never fit.
        """
        reservation = reservation or Reservation(self)
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._lock:
                self._waiters.append((loop, event))
            try:
                reservation.resize(nbytes, purpose)
                return reservation
            except OverloadedError:
                await event.wait()
            finally:
                with self._lock:
                    self._waiters.remove((loop, event))

    def describe(self) -> dict[str, int]:
        return {"memory_in_use_bytes": self.in_use, "memory_peak_bytes": self.peak,
                "memory_refused_calls": self.refused}

    # ------------------------------------------------------------ reservations

    def _change(self, old: int, new: int, purpose: str) -> None:
        """Move a reservation from ``old`` to ``new`` bytes (all or nothing)."""
        bulk = new > SMALL_BYTES
        with self._lock:
            in_use = self.in_use - old + new
            bulk_in_use = self.bulk_in_use - (old if old > SMALL_BYTES else 0) + (
                new if bulk else 0)
            if new > old and (in_use > self.limit or bulk_in_use > self.bulk_limit):
                self.refused += 1
                ceiling = self.bulk_limit if bulk else self.limit
                if new > ceiling:
                    raise LimitExceededError(
                        f"{purpose} needs {format_bytes(new)} of memory, more than the "
                        f"{format_bytes(ceiling)} {self.what} allows any call"
                        f"{' this large' if bulk else ''} ({self.what} = "
                        f"{format_bytes(self.limit)}); ask for less at once")
                raise OverloadedError(
                    f"{purpose} needs {format_bytes(new)} of memory but calls in flight hold "
                    f"{format_bytes(self.in_use)} of {self.what} = {format_bytes(self.limit)}; "
                    f"the call was not run: try again later")
            self.in_use, self.bulk_in_use = in_use, bulk_in_use
            self.peak = max(self.peak, in_use)
            waiters = list(self._waiters) if new < old else []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)


class Reservation:
    """Bytes one call holds from a :class:`MemoryBudget`; :meth:`release` gives them back.

    Thread-safe; :meth:`release` is idempotent.
    """

    __slots__ = ("_budget", "nbytes", "_lock")

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.nbytes = 0
        self._lock = threading.Lock()

    def resize(self, nbytes: int, purpose: str) -> None:
        """Hold ``nbytes`` from now on (more: reserved now or refused; fewer: released).

        Raises:
            LimitExceededError, OverloadedError: see :meth:`MemoryBudget.reserve`;
                the reservation keeps its old size.
        """
        with self._lock:
            self._budget._change(self.nbytes, nbytes, purpose)
            self.nbytes = nbytes

    def release(self, *_: object) -> None:
        """Give everything back (accepts and ignores a done-callback's argument)."""
        with self._lock:
            if self.nbytes:
                self._budget._change(self.nbytes, 0, "")
                self.nbytes = 0
