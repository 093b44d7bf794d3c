"""``InlineLanes``: a call to one shard made on the caller's thread, under the per-shard deadline.

A sharded call that reaches one shard only (an insert whose rows all go to
one shard: always with one shard; a priority update whose ids all live on
one) has nothing to run concurrently, yet the pooled path
(:meth:`~replay_client.sharded.shard_set.ShardSet.each`) hands it to a pool
thread and waits on its future so that the per-shard deadline can give up on
it: two thread wake-ups and the deadline's bookkeeping, about as much client
CPU as the call's own Python. Here the caller's thread makes the call itself,
blocking in gRPC, and one watchdog thread per client keeps the per-shard
deadline (:mod:`replay_client.sharded.deadline`) with the same outcomes:

* the call answers within ``shard_deadline_s``: its result or error, as
  pooled (the watchdog never wakes for it);
* it has not: the shard is probed (the same ``Info`` probe, ``shard_deadline_s``
  long). The probe answers: the shard is alive and merely slow; the call is
  waited for as long as its own timeout allows. The probe finds the server
  silent, or does not end within ``shard_deadline_s``: the call is *late*
  and fails with the :class:`~replay_client.errors.UnavailableError` the
  pooled path raises (same message), which the caller treats as any
  unavailable shard (a degraded client: down, resent elsewhere).

A late call cannot be left running as a pooled one is (its thread is the
caller's), so it is ended: each shard's inline calls travel on a *lane*, a
one-server client of their own (made by the shard set's factory, same
address and options; gRPC shares the TCP connection with the shard's own
client), and a late call's lane is cancelled
(:meth:`~replay_client.connection.Connection.cancel`): calls on it end,
retries on it stop, and the next inline call to the shard gets a new lane.
Every call then on the cancelled lane fails as late (they were waiting on a
server a probe just found silent); the shard's own client, its streams and
pooled calls are untouched. As with a pooled late call, the server may yet
have stored a late insert (degraded mode may then store it twice).

Clients without a :class:`~replay_client.connection.Connection` (a custom
factory's) have no lane: their calls stay pooled.

Cost: the common call pays a lock and a dict entry in and out; the watchdog
wakes every ``shard_deadline_s / 8`` (at most 0.1 s) while inline calls are
being made, and ends after a few idle seconds. A late call costs a probe.
Thread-safety: every method may be called from any thread; many threads may
run inline calls to one shard at once (they share its lane).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from replay_client.connection import Connection
from replay_client.errors import ReplayError
from replay_client.sharded.deadline import is_silent, late_error

_TICK_MAX_S = 0.1  # the watchdog's longest sleep while calls are watched
_IDLE_TICKS = 50  # ticks without a call after which the watchdog thread ends


class _Watch:
    """One inline call under watch: its shard, lane, deadline and what the watchdog found."""

    __slots__ = ("shard", "client", "lane", "deadline", "probe", "probe_end", "alive", "late",
                 "done")

    def __init__(self, shard: int, client: Any, lane: Any, deadline: float) -> None:
        self.shard, self.client, self.lane, self.deadline = shard, client, lane, deadline
        self.probe: Future | None = None
        self.probe_end = 0.0
        self.alive = False  # the probe answered: waited for until its own timeout
        self.late = False  # the lane was cancelled: the call fails as late
        self.done = False  # the call returned (set by the caller's thread)


class InlineLanes:
    """Inline calls to single shards and their watchdog (see the module docstring).

    Args:
        factory: builds a one-server client from an address (and ``options``),
            the shard set's own factory.
        options: given to every lane's client.
        deadline_s: the per-shard deadline (``shard_deadline_s``).
        probe: starts a probe of a shard's own client (a future that succeeds if
            the server answered); ``None``: it cannot be probed (waited for).
        where: names a shard in errors (``"shard 1 (127.0.0.1:5000)"``).
    """

    def __init__(self, factory: Callable[..., Any], options: dict[str, Any], deadline_s: float,
                 probe: Callable[[Any], Future | None], where: Callable[[int], str]) -> None:
        self._factory = factory
        self._options = options
        self._deadline = deadline_s
        self._probe = probe
        self._where = where
        self._tick = min(deadline_s / 8, _TICK_MAX_S)
        self._cond = threading.Condition(threading.RLock())  # a done probe's callback runs at once
        self._lanes: dict[int, tuple[Any, Any]] = {}  # shard -> (its client, the lane's client)
        self._watches: dict[int, _Watch] = {}  # in order of start (so of deadline)
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None
        self._idle = 0
        self._closed = False

    def lane(self, shard: int, client: Any) -> Any | None:
        """The lane of ``shard`` (whose own client is ``client``): made on first use, and again
        when the shard's client changed (it came back elsewhere) or its lane was cancelled;
        ``None`` when ``client`` has no :class:`Connection` (its calls stay pooled)."""
        pair = self._lanes.get(shard)
        if pair is not None and pair[0] is client:
            return pair[1]
        if not isinstance(getattr(client, "connection", None), Connection):
            return None
        with self._cond:
            pair = self._lanes.get(shard)
            if pair is not None and pair[0] is client:
                return pair[1]
            lane = self._factory(client.connection.address, **self._options)
            if not isinstance(getattr(lane, "connection", None), Connection):
                lane.close()
                return None
            lane.connection.answered = client.connection.answered  # the same server answered
            old, self._lanes[shard] = self._lanes.get(shard), (client, lane)
        if old is not None:
            old[1].close()
        return lane

    def run(self, shard: int, client: Any, lane: Any, call: Callable[[Any], Any]) -> Any:
        """``call(lane)`` on this thread, watched: its result, or the :class:`ReplayError` it
        failed with (the late :class:`UnavailableError` if the watchdog cancelled its lane),
        as :func:`~replay_client.sharded.deadline.settle` gives a shard's outcome."""
        key = next(self._keys)
        with self._cond:  # deadlines taken under the lock: the watches stay in their order
            watch = _Watch(shard, client, lane, time.monotonic() + self._deadline)
            self._watches[key] = watch
            self._closed = False
            if self._thread is None or not self._thread.is_alive():  # none yet, or forked
                self._thread = threading.Thread(target=self._watch_loop, daemon=True,
                                                name="replay-shard-deadline")
                self._thread.start()
        try:
            return call(lane)
        except ReplayError as exc:
            return late_error(self._where(shard), self._deadline) if watch.late else exc
        except Exception:  # gRPC's own error for a channel closed under a call
            if watch.late:
                return late_error(self._where(shard), self._deadline)
            raise
        finally:
            watch.done = True
            with self._cond:
                del self._watches[key]

    def close(self) -> None:
        """Close every lane (a call in flight on one fails) and end the watchdog (a later
        call starts them again)."""
        with self._cond:
            self._closed = True
            lanes, self._lanes = self._lanes, {}
            self._cond.notify_all()
        for _, lane in lanes.values():
            lane.close()

    # ------------------------------------------------------------ the watchdog

    def _watch_loop(self) -> None:
        with self._cond:
            while not self._closed:
                self._check(time.monotonic())
                if self._watches:
                    self._idle = 0
                else:
                    self._idle += 1
                    if self._idle > _IDLE_TICKS:
                        break
                self._cond.wait(self._tick)
            self._thread = None

    def _check(self, now: float) -> None:
        """Probe the calls past their deadline, cancel the lanes of those found late
        (under ``_cond``)."""
        for watch in list(self._watches.values()):
            if watch.deadline > now:
                break  # the later ones started later
            if watch.done or watch.alive or watch.late:
                continue
            if watch.probe_end == 0.0:  # not probed yet
                watch.probe = self._probe(watch.client)
                watch.probe_end = now + self._deadline
                if watch.probe is None:
                    watch.alive = True  # cannot probe: waited for, as pooled
                    continue
                watch.probe.add_done_callback(self._wake)
            probe = watch.probe
            assert probe is not None
            if probe.done():
                if is_silent(probe.exception()):
                    self._cancel(watch)
                else:
                    watch.alive = True
            elif now >= watch.probe_end:
                self._cancel(watch)

    def _cancel(self, watch: _Watch) -> None:
        """End ``watch``'s lane: every call on it fails as late; the next call gets a new one."""
        for other in self._watches.values():
            if other.lane is watch.lane and not other.done:
                other.late = True
        pair = self._lanes.get(watch.shard)
        if pair is not None and pair[1] is watch.lane:
            del self._lanes[watch.shard]
        watch.lane.connection.cancel(  # what a call on it meanwhile gets (named by the caller)
            f"the server did not answer within the per-shard deadline "
            f"(shard_deadline_s={self._deadline:g}), nor a probe: its inline calls were given up")

    def _wake(self, _: Future) -> None:
        with self._cond:
            self._cond.notify_all()
