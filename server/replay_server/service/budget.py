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
``limit_exceeded``). Streams wait for room instead (:meth:`MemoryBudget.wait`),
and so do unary and chunked calls, for a second.

**Waiters are served fairly.** A call that waits for room joins a
:class:`~replay_server.service.fair_queue.FairQueue` under its address
(host): room that frees is offered to each address's oldest waiter in turn,
and a waiter that does not fit yet keeps its turn (no one behind it is
granted room first: else calls wanting a few MiB would take every piece
that frees and starve one wanting 20). Only a stream's next group of
batches, a wait with no end of its own, is passed over while it does not
fit, so it never holds up the calls behind it; every other waiter gives up
within ``server.memory_wait_s`` (a second), so its turn is short. While anyone waits, a new reservation above
:data:`SMALL_BYTES` that would take room without waiting is refused, so its
caller queues behind those already waiting instead of overtaking them.
Before, every release woke every waiter to race for it, so one address
with twenty waiting 100 MiB inserts won the room twenty times out of
twenty-one against another address's one.

Small calls are never crowded out by large ones: reservations above
:data:`SMALL_BYTES` together take at most :data:`BULK_SHARE` of the budget,
so the rest always serves small samples, updates and inserts.

Thread-safety: reservations are made and released from any thread (the
event loop, the engine's pool); :meth:`MemoryBudget.wait` runs on the event
loop, all waiters of one budget on one loop (room is granted there).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TypeVar

from replay_server.engine import format_bytes
from replay_server.service.fair_queue import FairQueue
from replay_server.service.limits import BULK_SHARE
from replay_server.service.status import LimitExceededError, OverloadedError

E = TypeVar("E", OverloadedError, LimitExceededError)

SMALL_BYTES = 1 << 20
"""Reservations up to this size may use the whole budget."""

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
        refused: calls a refusal of this budget ended so far (told by
            :func:`~replay_server.service.status.abort`); a try refused that the call then
            waited out is not one.
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
        self._queue: FairQueue[_Waiter] = FairQueue()  # event loop only
        self._queued = 0  # len(self._queue), read by any thread under _lock
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiters' loop
        self._offer_due = False

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
                   owner: Reservation | None = None, peer: str = "",
                   bounded: bool = True) -> Reservation:
        """Reserve ``nbytes`` (or grow ``reservation`` to them; a new one a part of
        ``owner``'s, if given), waiting (on the event loop) until they fit, served in turn
        with the other waiters of ``peer`` (the caller's host) and across peers (see the
        module docstring); ``bounded``: the caller gives up soon (it keeps its turn while it
        does not fit), else it is passed over until it fits.

        Raises:
            LimitExceededError: ``nbytes`` could never fit.
            OverloadedError: the reservation (or its owner) was released: its call ended.
        """
        reservation = reservation or Reservation(self, owner)
        if not self._queued:  # nobody waits: no one to overtake
            try:
                reservation.resize(nbytes, purpose)
                return reservation
            except OverloadedError:
                if reservation.closed:
                    raise
        loop = asyncio.get_running_loop()
        waiter = _Waiter(reservation, nbytes, purpose, loop.create_future(), bounded)
        with self._lock:
            if self._loop is not loop and self._queued:
                raise RuntimeError("MemoryBudget.wait: every waiter must run on one event loop")
            self._loop = loop
            self._queued += 1
        self._queue.push(peer, waiter)
        try:
            self._offer()
            await waiter.granted
            return reservation
        finally:
            if not waiter.granted.done() or waiter.granted.cancelled():
                self._leave(peer, waiter)

    def _leave(self, peer: str, waiter: _Waiter) -> None:
        """``waiter`` stopped waiting before it was served (its call ended or timed out)."""
        if self._queue.remove(peer, waiter):
            with self._lock:
                self._queued -= 1

    def _offer(self) -> None:
        """Offer the room free now to the waiters' heads in turn (event loop only), granting
        each that fits, round after round, until a bounded one does not fit."""
        self._offer_due = False
        granted = True
        while granted and len(self._queue):
            granted = self._offer_round()

    def _offer_round(self) -> bool:
        """One round of :meth:`_offer`: whether it granted anything and may go on."""
        granted = False
        for peer, waiter in self._queue.heads():
            if waiter.granted.done():  # cancelled: its task leaves the line when it runs
                self._leave(peer, waiter)
                continue
            try:
                waiter.reservation.resize(waiter.nbytes, waiter.purpose, queued=True)
            except OverloadedError as exc:
                if not waiter.reservation.closed:
                    if waiter.bounded:
                        return False  # it keeps its turn: no one behind it goes first
                    continue  # a stream's group: passed over while it does not fit
                waiter.granted.set_exception(exc)
            except LimitExceededError as exc:
                waiter.granted.set_exception(exc)
            else:
                waiter.granted.set_result(None)
                granted = True
            self._queue.served(peer)
            with self._lock:
                self._queued -= 1
        return granted

    def _offer_soon(self) -> None:
        """Room was freed (any thread): offer it to the waiters on their loop, once."""
        loop = self._loop
        if loop is None or self._offer_due:
            return
        self._offer_due = True
        try:
            loop.call_soon_threadsafe(self._offer)
        except RuntimeError:  # the loop is closed: nobody waits on it any more
            self._offer_due = False

    def _counted(self, refusal: E) -> E:
        """``refusal``, counted in :attr:`refused` if it ends a call (not when its call waits
        for room and tries again, nor a stream's group that waits its turn)."""
        refusal.counted_by = self._count_refusal
        return refusal

    def _count_refusal(self) -> None:
        with self._lock:
            self.refused += 1

    def describe(self) -> dict[str, int]:
        return {"memory_in_use_bytes": self.in_use, "memory_peak_bytes": self.peak,
                "memory_refused_calls": self.refused, "memory_waiting_calls": self.waiting}

    @property
    def waiting(self) -> int:
        """Calls waiting for room now (:meth:`wait`)."""
        return self._queued

    # ------------------------------------------------------------ reservations

    def _change(self, old: int, new: int, purpose: str, queued: bool = False) -> None:
        """Move a reservation from ``old`` to ``new`` bytes (all or nothing); ``queued``: a
        grant to a waiter in turn (any other large growth waits behind the waiters)."""
        bulk = new > SMALL_BYTES
        with self._lock:
            in_use = self.in_use - old + new
            bulk_in_use = self.bulk_in_use - (old if old > SMALL_BYTES else 0) + (
                new if bulk else 0)
            ceiling = self.bulk_limit if bulk else self.limit
            overtakes = bulk and self._queued and not queued and new <= ceiling
            if new > old and (overtakes or in_use > self.limit
                              or bulk_in_use > self.bulk_limit):
                if overtakes:
                    raise self._counted(OverloadedError(
                        f"{purpose} needs {format_bytes(new)} of memory while "
                        f"{self._queued} call(s) wait for room in {self.what} before it; "
                        f"the call was not run: try again later"))
                if new > ceiling:
                    raise self._counted(LimitExceededError(
                        f"{purpose} needs {format_bytes(new)} of memory, more than the "
                        f"{format_bytes(ceiling)} {self.what} allows any call"
                        f"{' this large' if bulk else ''} ({self.what} = "
                        f"{format_bytes(self.limit)}); ask for less at once"))
                raise self._counted(OverloadedError(
                    f"{purpose} needs {format_bytes(new)} of memory but calls in flight hold "
                    f"{format_bytes(self.in_use)} of {self.what} = {format_bytes(self.limit)}; "
                    f"the call was not run: try again later"))
            self.in_use, self.bulk_in_use = in_use, bulk_in_use
            self.peak = max(self.peak, in_use)
            freed = new < old and self._queued
        if freed:
            self._offer_soon()


class _Waiter:
    """One call waiting for room: what to grow, to how much, and the future its grant sets."""

    __slots__ = ("reservation", "nbytes", "purpose", "granted", "bounded")

    def __init__(self, reservation: Reservation, nbytes: int, purpose: str,
                 granted: asyncio.Future[None], bounded: bool) -> None:
        self.reservation, self.nbytes, self.purpose = reservation, nbytes, purpose
        self.granted, self.bounded = granted, bounded


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

    def resize(self, nbytes: int, purpose: str, queued: bool = False) -> None:
        """Hold ``nbytes`` from now on (more: reserved now or refused; fewer: released);
        ``queued``: the budget grants it to a waiter in turn (:meth:`MemoryBudget.wait`).

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
            self._budget._change(self.nbytes, nbytes, purpose, queued)
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
