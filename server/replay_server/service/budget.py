"""The process' memory budget for calls: bytes reserved before they are held.

Every call reserves, from one :class:`MemoryBudget`, the bytes it is about
to hold, *before* it holds them: the request before it is read (its declared
size, else the message limit), a sampled batch before it is drawn (the batch
and its encoding), a stream's group of batches before it is drawn. A
reservation is released when the bytes are gone: a unary call's when gRPC
has handed its whole response to the socket (a slow reader keeps it
reserved), a stream group's when its last chunk was sent.

**Every reservation has an owner.** A call's first reservation (made when it
is admitted) is released by gRPC's end-of-call callback, which runs on every
path: success, error, cancel, a reset stream, a cut connection, the server
stopping. Everything else the call reserves (a stream's groups of batches,
its shared-memory ring) is a *part* of that reservation
(``Reservation(budget, owner=call_reservation)``): releasing the owner
releases its parts, and a reservation released once is closed (it can never
hold bytes again, so engine work finishing after its call ended cannot
reserve what nobody would release). Before, a stream reset while a group
was being sent left the group's bytes reserved for good (issue 34: 21
resets left 762 MiB of 768 reserved).

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

from replay_server.engine import format_bytes
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

    def reserve(self, nbytes: int, purpose: str,
                owner: Reservation | None = None) -> Reservation:
        """Reserve ``nbytes`` for ``purpose`` now (a part of ``owner``'s, if given), or refuse.

        Raises:
            LimitExceededError: ``nbytes`` could never fit.
            OverloadedError: it does not fit now, or ``owner`` was released (its call ended).
        """
        reservation = Reservation(self, owner)
        try:
            reservation.resize(nbytes, purpose)
        except BaseException:
            reservation.release()
            raise
        return reservation

    async def wait(self, nbytes: int, purpose: str, reservation: Reservation | None = None,
                   owner: Reservation | None = None) -> Reservation:
        """Reserve ``nbytes`` (or grow ``reservation`` to them; a new one a part of
        ``owner``'s, if given), waiting (on the event loop) until they fit.

        Raises:
            LimitExceededError: ``nbytes`` could never fit.
            OverloadedError: the reservation (or its owner) was released: its call ended.
        """
        reservation = reservation or Reservation(self, owner)
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._lock:
                self._waiters.append((loop, event))
            try:
                reservation.resize(nbytes, purpose)
                return reservation
            except OverloadedError:
                if reservation.closed:
                    raise
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

    A reservation made with an ``owner`` is a part of it: releasing the owner
    releases the part too (see the module docstring). A released reservation
    is closed: growing it again raises :class:`OverloadedError`, and a part
    made for a closed owner is closed from the start.

    Args:
        budget: where the bytes are reserved.
        owner: the reservation (of any budget) whose release releases this one.

    Thread-safe; :meth:`release` is idempotent.
    """

    __slots__ = ("_budget", "nbytes", "_lock", "_owner", "_parts", "closed")

    def __init__(self, budget: MemoryBudget, owner: Reservation | None = None) -> None:
        self._budget = budget
        self.nbytes = 0
        self._lock = threading.Lock()
        self._parts: set[Reservation] = set()
        self.closed = False
        self._owner = owner
        if owner is not None:
            owner._adopt(self)

    def resize(self, nbytes: int, purpose: str) -> None:
        """Hold ``nbytes`` from now on (more: reserved now or refused; fewer: released).

        Raises:
            LimitExceededError, OverloadedError: see :meth:`MemoryBudget.reserve`;
                the reservation keeps its old size.
            OverloadedError: the reservation was released (its call ended) and
                ``nbytes`` is not 0.
        """
        with self._lock:
            if self.closed:
                if nbytes:
                    raise OverloadedError(f"{purpose or 'a reservation'}: its call has ended; "
                                          f"nothing more is reserved for it")
                return
            self._budget._change(self.nbytes, nbytes, purpose)
            self.nbytes = nbytes

    def release(self, *_: object) -> None:
        """Give everything back, this reservation's and its parts', and close it (accepts and
        ignores a done-callback's argument)."""
        with self._lock:
            self.closed = True
            parts, self._parts = self._parts, set()
            if self.nbytes:
                self._budget._change(self.nbytes, 0, "")
                self.nbytes = 0
        for part in parts:
            part.release()
        owner = self._owner
        if owner is not None:
            owner._disown(self)

    def _adopt(self, part: Reservation) -> None:
        with self._lock:
            if not self.closed:
                self._parts.add(part)
                return
        part.closed = True  # the call ended already: the part can never hold bytes

    def _disown(self, part: Reservation) -> None:
        with self._lock:
            self._parts.discard(part)
