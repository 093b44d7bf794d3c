"""``ShardSet``: the servers of a sharded client, found, connected, called together, and followed.

A sharded client's shards are the servers its address names
(:mod:`replay_client.sharded.discovery`), each known by the shard index it
reports. The set follows the cluster: a ``shards://`` name is resolved again
every ``resolve_interval_s`` seconds and after a call finds a shard
unavailable (at most once a second), so

* a server that appears under the name (a StatefulSet scaled up) is asked
  its index and joins: inserts and samples reach it without a restart;
* a shard whose address the name no longer gives is *down*: in degraded
  mode calls leave it out (as any unavailable shard); by default calls that
  need it fail naming it;
* a shard that comes back on another address (a pod rescheduled) is
  reached there;
* a shard the name no longer gives whose index is past the replay's
  expected count (a ``ray://`` replay scaled down: its rows were moved to
  the shards that stay) is *retired*: dropped from the set, not down, and
  priority updates naming its ids are skipped and counted as stale ones
  are (``skipped_updates``).

With ``allow_degraded=True`` a client can be created, and used, while some
of its servers do not answer yet: they are tried again at each resolution
(their index, and so which ids they own, is unknown until they answer).

Where the name says how many shards the replay has (``shards://...?expected=N``,
or a ``ray://`` registry, :class:`~replay_client.sharded.discovery.Resolution`),
a shard that has not been found is *absent*, and known to be: a strict client
waits for it (re-resolving, at most ``wait_for_shards_s``), then refuses with
:class:`UnavailableError` naming it (and what the registry says of it); a
degraded client goes on and every merged sample lists it in
``missing_shards``. Either way no client takes the shards it found for the
whole replay. While a shard is absent, gone or down (a stream lost it), the
name is resolved again at most once a second (a restarted shard is found at
its new address).

Every shard has ``shard_deadline_s`` to answer its part of a call, and a probe
as long again (:mod:`replay_client.sharded.deadline`): a shard silent past
both is unavailable, so a hung server costs a call at most twice the
deadline, never the call's whole timeout; a server that does not answer within
the deadline when first asked its index (that ask is a probe) is treated alike
(pending in degraded mode, named in the error by default). After the first,
a degraded client resolves in the background (callers go on with the set
they have meanwhile), so a pending server that stays silent costs no caller
anything. A degraded client's down shards are probed in the
background (:mod:`replay_client.sharded.prober`), not by callers' calls.

Thread-safety: every method may be called from any thread; the set is
replaced whole (readers see the old or the new one, never half of it), and
one caller at a time resolves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any

import numpy as np

from replay_client.errors import (
    DeadlineExceededError,
    ReplayError,
    ShardingError,
    UnavailableError,
)
from replay_client.sharded.deadline import (
    DEFAULT_SHARD_DEADLINE_S,
    is_silent,
    probe_call,
    settle,
)
from replay_client.sharded.discovery import Resolution, Resolver, named, resolve
from replay_client.sharded.health import ShardHealth
from replay_client.sharded.lanes import InlineLanes
from replay_client.sharded.prober import ShardProber
from replay_client.sharded.routing import by_owner
from replay_proto.id_layout import shard_of

RETRY_RESOLVE_S = 1.0
"""After a call found a shard unavailable, the name is resolved again at most this often."""

_WAIT_PAUSE_S = (0.05, 0.5)  # a strict client waiting for absent shards: resolves this often


class ShardSet:
    """See the module docstring.

    Args:
        spec: a list of ``host:port`` or a ``shards://NAME:PORT`` name.
        factory: builds a one-server client from an address (and ``options``).
        options: given to every shard's client.
        resolver: resolves a name (``None``: the system's resolver).
        degraded: go on without unavailable shards (see ``allow_degraded``).
        resolve_interval_s: how often a name is resolved again, and servers that
            had not answered are asked again (``None``: only after a failure).
        forget: told when a shard may have come back with other rows (its
            masses must be asked again).
        wait_for_shards_s: how long a strict client waits for absent shards
            before it refuses (see the module docstring).
        shard_deadline_s: how long a shard has to answer its part of a call, and
            a probe after that (:mod:`replay_client.sharded.deadline`).
    """

    def __init__(self, spec: Any, factory: Callable[..., Any], options: Mapping[str, Any], *,
                 resolver: Resolver | None, degraded: bool, resolve_interval_s: float | None,
                 forget: Callable[[int], None], wait_for_shards_s: float = 10.0,
                 shard_deadline_s: float = DEFAULT_SHARD_DEADLINE_S) -> None:
        self.spec = spec
        self.health = ShardHealth()
        self._deadline = shard_deadline_s
        self._probes: ThreadPoolExecutor | None = None  # made by the first probe, shut by close
        self._prober = ShardProber(self.health, self._ask)
        self._factory = factory
        self._options = dict(options)
        self._resolver = resolver
        self._degraded = degraded
        self._interval = resolve_interval_s
        self._forget = forget
        self._lock = threading.Lock()
        self._resolving = threading.Lock()
        self._clients: dict[int, Any] | None = None
        self._addresses: dict[int, str] = {}
        self._pending: dict[str, Any] = {}  # addresses whose server has not answered yet
        self._background: threading.Thread | None = None  # a degraded client's resolution
        self._gone: set[int] = set()  # shards whose address the name no longer gives
        self.retired: set[int] = set()  # shards a scale down removed (see the docstring)
        self._next_resolve = 0.0
        self._last_resolve = 0.0
        self._failures: dict[str, ReplayError] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._wait_s = wait_for_shards_s
        self._expected: int | None = None
        self._absent: dict[int, str] = {}  # expected shards not found: index -> why
        self._lanes = InlineLanes(factory, self._options, shard_deadline_s, self._probe,
                                  lambda s: f"shard {s} ({self.address_of(s)})")

    # ------------------------------------------------------------ the set

    def clients(self) -> dict[int, Any]:
        """Shard index -> one-server client, in index order (found on first use, resolved
        again when due)."""
        clients = self._clients
        if clients is None:
            with self._resolving:
                if self._clients is None:
                    self._resolve(first=True)
            clients = self._clients
        elif ((self._interval is not None and time.monotonic() >= self._next_resolve
               and (isinstance(self.spec, str) or self._pending)) or (
                (self._absent or self._gone or self.health.any_down)
                and time.monotonic() >= self._last_resolve + RETRY_RESOLVE_S)):
            self._resolve_again()  # a name again, (a list) the servers that had not
            clients = self._clients  # answered, or an absent or gone shard looked for again
        if self._absent and not self._degraded:
            self._await_absent()
            clients = self._clients
        assert clients is not None
        return clients

    @property
    def known(self) -> list[int]:
        """The shards whose ids are valid now, without connecting: every expected index
        (where the name gives a count), else those found."""
        if self._expected is not None:
            return list(range(self._expected))
        return sorted(self._clients or {})

    @property
    def absent(self) -> tuple[int, ...]:
        """Expected shards not found (their index), in index order. Without a count, servers
        that have not answered yet (degraded mode) are taken to hold the lowest indices of
        ``0..n-1`` no server reports (``n``: the addresses; ``shard = "auto"`` numbers so)."""
        absent = set(self._absent)
        if self._expected is None and self._pending:
            found = set(self._clients or {})
            free = [i for i in range(len(found) + len(self._pending)) if i not in found]
            absent.update(free[:len(self._pending)])
        return tuple(sorted(absent))

    def _await_absent(self) -> None:
        """A strict client: resolve until every expected shard is found, at most
        ``wait_for_shards_s``; then refuse, naming the shards still absent."""
        deadline = time.monotonic() + self._wait_s
        pause, last = _WAIT_PAUSE_S[0], None
        while self._absent:
            left = deadline - time.monotonic()
            if left <= 0:
                found = len(self._clients or {})
                why = "; ".join(self._absent.values())
                raise UnavailableError(
                    f"{self.spec!r}: {len(self._absent)} of {self._expected} shards not found "
                    f"after waiting {self._wait_s:g} s: {why}"
                    f"{f' (last resolution: {last})' if last else ''}. A strict client never "
                    f"takes the {found} shard(s) it found for the whole replay; "
                    f"allow_degraded=True uses them and lists the others in missing_shards")
            time.sleep(min(pause, left))
            pause = min(2 * pause, _WAIT_PAUSE_S[1])
            with self._resolving:
                try:
                    self._resolve(first=False)
                except UnavailableError as exc:
                    last = exc

    @property
    def addresses(self) -> dict[int, str]:
        """Shard index -> address now."""
        self.clients()
        return dict(self._addresses)

    def address_of(self, shard: int) -> str:
        return self._addresses.get(shard, "?")

    @property
    def unidentified(self) -> int:
        """Addresses whose server has not answered yet (degraded mode)."""
        return len(self._pending)

    def resolve(self, *, soon: bool = False) -> None:
        """Resolve the name again (and ask servers that had not answered); skipped while
        another thread does, or (``soon``: after a failure) if it was done within a second."""
        if soon and (time.monotonic() < self._last_resolve + RETRY_RESOLVE_S or (
                not isinstance(self.spec, str) and not self._pending)):
            return
        if not self._resolving.acquire(blocking=False):
            return
        try:
            if self._clients is not None:  # not closed meanwhile
                self._resolve(first=False)
        finally:
            self._resolving.release()

    def _resolve_again(self, soon: bool = False) -> None:
        """:meth:`resolve`: in the caller's thread for a strict client; in the background
        for a degraded one, whose callers go on with the set they have (a server that does
        not answer would hold each of them for the per-shard deadline)."""
        if not self._degraded:
            self.resolve(soon=soon)
            return
        with self._lock:
            if self._background is not None and self._background.is_alive():
                return
            self._background = threading.Thread(
                target=self.resolve, kwargs={"soon": soon}, name="replay-shards-resolve",
                daemon=True)
            self._background.start()

    def _resolve(self, first: bool) -> None:
        """Find the servers the spec names now and make them the set (under ``_resolving``)."""
        now = self._last_resolve = time.monotonic()
        self._next_resolve = now + (self._interval or 0.0)
        resolution: Resolution | None
        try:
            resolution = resolve(self.spec, self._resolver)
            wanted = list(resolution.addresses)
            self._expected = resolution.expected
        except UnavailableError:
            if (first or not self._clients) and self._expected is None:
                raise
            resolution = None  # keep what we have
            wanted = list(self._addresses.values()) + list(self._pending)
        known = {address: shard for shard, address in self._addresses.items()}
        clients = dict(self._clients or {})
        addresses = dict(self._addresses)
        for client in self._pending.values():  # asked afresh: a new channel, no old backoff
            client.close()
        ask = {a: self._factory(a, **self._options) for a in wanted if a not in known}
        found = self._identify(ask, wait=self._degraded or self._expected is not None)
        pending = {a: c for a, c in ask.items() if a not in found}
        for address, (client, shard) in found.items():
            if shard in clients and addresses[shard] in wanted:  # two live servers, one index
                for c in ask.values():
                    c.close()
                raise _same_index(addresses[shard], address, shard)
            old = clients.get(shard)
            if old is not None:  # the shard came back on another address
                old.close()
            clients[shard], addresses[shard] = client, address
            self._forget(shard)
            if not first or shard in self._absent:
                self.health.answered([shard])
        if resolution is not None and resolution.expected is not None:
            self._retire(clients, addresses, wanted, resolution.expected)
        gone = {shard for shard, address in addresses.items() if address not in wanted}
        for shard in gone - self._gone:
            said = resolution.why_missing(shard) if resolution is not None else None
            self.health.failed(shard, said or f"{addresses[shard]} is no longer among the "
                                              f"addresses {self.spec!r} resolves to")
        if not first:
            self.health.answered(self._gone - gone)  # named again
        self._gone = gone
        self._absent = self._absent_of(clients, resolution)
        if first and not clients and self._expected is None:
            reasons = "; ".join(f"{a}: {e}" for a, e in self._failures.items())
            raise UnavailableError(f"no server of {self.spec!r} answered ({reasons})")
        order = sorted(clients)
        with self._lock:
            self._clients = {s: clients[s] for s in order}
            self._addresses = {s: addresses[s] for s in order}
            self._pending = pending
            # Room for calls left running past their shard's deadline (until their timeout).
            workers = 4 * len(order) + 4
            if self._pool is None or self._pool._max_workers < workers:  # noqa: SLF001
                old_pool, self._pool = self._pool, ThreadPoolExecutor(
                    max_workers=workers, thread_name_prefix="replay-shards")
                if old_pool is not None:
                    old_pool.shutdown(wait=False)

    def _retire(self, clients: dict[int, Any], addresses: dict[int, str], wanted: list[str],
                expected: int) -> None:
        """Drop the shards past ``expected`` that the name no longer gives (a scale down)."""
        retired = [s for s in clients if s >= expected and addresses[s] not in wanted]
        for shard in retired:
            clients.pop(shard).close()
            del addresses[shard]
        for shard in retired and [*retired, *clients]:  # the others took the retired rows
            self._forget(shard)
        self.retired.update(retired)
        self.retired.difference_update(clients)  # an index that serves again (scaled up)
        self.health.retired(retired)

    def owners(self, ids: Any, clients: Mapping[int, Any], nothing_done: str) -> dict[int, Any]:
        """:func:`~replay_client.sharded.routing.by_owner` over ``clients``, ids of retired
        shards skipped and counted (``skipped_updates``: their rows live on elsewhere under
        new ids, as an overwritten row's update is stale)."""
        if self.retired:
            gone = np.isin(shard_of(ids), list(self.retired))
            if gone.any():
                self.health.count("skipped_updates", int(gone.sum()))
                kept = by_owner(ids[~gone], clients, nothing_done)
                return {s: np.flatnonzero(~gone)[rows] for s, rows in kept.items()}
        return by_owner(ids, clients, nothing_done)

    def sendable(self, ids: Any, clients: Mapping[int, Any]) -> Any:
        """In degraded mode, while some server has not answered yet or an expected shard is
        missing, an id of no known shard may be one of its: the mask of ``ids`` that can be
        sent, the others skipped and counted (``skipped_updates``, as a down shard's).
        ``None``: every id can be sent."""
        if not self._degraded or not (self.unidentified or self.absent):
            return None
        owners = shard_of(ids)
        known = ((np.isin(owners, list(clients)) & (ids >= 0)) if self.unidentified
                 else ~np.isin(owners, self.absent))
        if known.all():
            return None
        self.health.count("skipped_updates", int((~known).sum()))
        return known

    def _absent_of(self, clients: Mapping[int, Any],
                   resolution: Resolution | None) -> dict[int, str]:
        """Expected shards without a server (index -> why), newly absent ones marked down."""
        expected = self._expected
        if expected is None:
            return {}
        absent = {}
        for shard in range(expected):
            if shard in clients:
                continue
            said = resolution.why_missing(shard) if resolution is not None else None
            absent[shard] = said or self._absent.get(shard) or (
                f"shard {shard}: no server of {self.spec!r} answered as it ({len(clients)} of "
                f"{expected} found{self._failed_addresses()})")
            if shard not in self._absent:
                self.health.failed(shard, absent[shard])
        return absent

    def _failed_addresses(self) -> str:
        if not self._failures:
            return ""
        return "; not answering: " + ", ".join(f"{a} ({e})" for a, e in self._failures.items())

    def _identify(self, ask: Mapping[str, Any], wait: bool) -> dict[str, tuple[Any, int]]:
        """Ask each new server its shard index, concurrently: ``address -> (client, shard)``.

        A server that does not answer fails the whole set by default (named);
        with ``wait`` (degraded mode, or an expected count that tells who is
        absent) it stays pending. Two new servers with one index are refused.
        """
        self._failures = {}
        if not ask:
            return {}
        pool = ThreadPoolExecutor(max_workers=len(ask), thread_name_prefix="replay-identify")
        futures = {a: pool.submit(c.server_info) for a, c in ask.items()}
        wait_all(list(futures.values()), timeout=self._deadline)  # the ask is itself a probe
        pool.shutdown(wait=False)
        found: dict[str, tuple[Any, int]] = {}
        where: dict[int, str] = {}
        for address, future in futures.items():
            try:
                if not future.done():
                    raise UnavailableError(f"no answer to Info within the per-shard deadline "
                                           f"(shard_deadline_s={self._deadline:g})")
                shard = future.result().shard
            except ReplayError as exc:
                if wait and isinstance(exc, (UnavailableError, DeadlineExceededError)):
                    self._failures[address] = exc
                    continue
                for client in ask.values():
                    client.close()
                raise named(exc, f"server {address}") from exc
            if shard in where:
                for client in ask.values():
                    client.close()
                raise _same_index(where[shard], address, shard)
            if self._expected is not None and shard >= self._expected:
                for client in ask.values():
                    client.close()
                raise ShardingError(f"{self.spec!r} expects shards 0..{self._expected - 1}, "
                                    f"but the server at {address} reports shard {shard}")
            where[shard] = address
            found[address] = (ask[address], shard)
        return found

    # ------------------------------------------------------------ calls

    def live(self, clients: Iterable[int]) -> list[int]:
        """The shards to call now: all, or in degraded mode those not down (raises if none)."""
        if not self._degraded:
            return list(clients)
        live = [s for s in self.health.live(clients) if s not in self._gone]
        if not live:
            raise UnavailableError(f"no shard is available (down: {self.health.stats().down})")
        return live

    def each(self, calls: Mapping[int, Callable[[Any], Any]],
             tolerate: bool = False, inline: bool = False) -> dict[int, Any]:
        """Run ``calls[shard](client)`` on those shards concurrently; their results by shard.

        ``tolerate`` (in degraded mode): a shard that fails as unavailable is
        marked down and left out of the results instead of failing the call.
        A shard found unavailable has the name resolved again soon.
        ``inline``: a call to one shard only is made on this thread, on the
        shard's lane (:mod:`replay_client.sharded.lanes`: the same deadline and
        outcomes); for calls a second one-server client of the shard may make
        as well as its own: no per-client state (inserts; not priority updates,
        which keep order with the client's own ``wait=False`` ones).

        Raises:
            ReplayError: the first failure in shard order, its message naming the shard.
        """
        clients = self.clients()
        outcomes = self._inline(calls, clients) if inline and len(calls) == 1 else None
        if outcomes is None:
            pool = self._pool
            assert pool is not None
            futures: dict[int, Future] = {
                s: pool.submit(self._on, s, call, clients[s]) for s, call in calls.items()}
            outcomes = settle(futures, self._deadline, lambda s: self._probe(clients[s]),
                              lambda s: f"shard {s} ({self.address_of(s)})")
        results, failure, lost = {}, None, False
        for shard, outcome in outcomes.items():
            if not isinstance(outcome, ReplayError):
                results[shard] = outcome
                continue
            lost = lost or isinstance(outcome, UnavailableError)
            if tolerate and self._degraded and isinstance(outcome, UnavailableError):
                self.health.failed(shard, str(outcome), probed=True)
                self._prober.watch(shard)  # asked again in the background, not by callers
                self._forget(shard)  # it may come back with other rows
            else:
                failure = failure or outcome
        if lost:
            self._resolve_again(soon=True)
        if failure is not None:
            raise failure
        if self._degraded:
            self.health.answered(results)
        return results

    def _inline(self, calls: Mapping[int, Callable[[Any], Any]],
                clients: Mapping[int, Any]) -> dict[int, Any] | None:
        """The one call of ``calls`` made on this thread (its outcome by shard, as
        :func:`settle` gives it); ``None``: its shard has no lane (a custom client)."""
        ((shard, call),) = calls.items()
        client = clients[shard]
        lane = self._lanes.lane(shard, client)
        if lane is None:
            return None
        return {shard: self._lanes.run(shard, client, lane,
                                       lambda c: self._on(shard, call, c))}

    def all(self, call: Callable[[Any], Any], tolerate: bool = False) -> dict[int, Any]:
        """``call`` on every shard (``tolerate``: on the live ones, see :meth:`each`)."""
        clients = self.clients()
        return self.each({s: call for s in (self.live(clients) if tolerate else clients)},
                         tolerate)

    def _probe(self, client: Any) -> Future | None:
        """Start a probe of ``client``'s server (``None``: it cannot be probed)."""
        call = probe_call(client, self._deadline)
        if call is None:
            return None
        with self._lock:
            if self._probes is None:
                self._probes = ThreadPoolExecutor(max_workers=16,
                                                  thread_name_prefix="replay-shard-probes")
            return self._probes.submit(call)

    def _ask(self, shard: int) -> str | None:
        """The background probe of a down shard: ``None`` if it answered (an error that is
        not unavailability is an answer too), else why not."""
        client = (self._clients or {}).get(shard)
        if client is None:
            return "not connected"
        call = probe_call(client, self._deadline) or client.server_info
        try:
            call()
        except ReplayError as exc:
            if is_silent(exc):
                return str(named(exc, f"shard {shard} ({self.address_of(shard)})"))
        return None

    def _on(self, shard: int, call: Callable[[Any], Any], client: Any) -> Any:
        try:
            return call(client)
        except ReplayError as exc:
            raise named(exc, f"shard {shard} ({self.address_of(shard)})") from exc

    def close(self) -> None:
        """Close every shard's client (a later call connects again)."""
        self._prober.close()
        self._lanes.close()
        with self._resolving, self._lock:
            clients, self._clients = self._clients, None
            pending, self._pending = self._pending, {}
            pool, self._pool = self._pool, None
            probes, self._probes = self._probes, None
        errors = []
        for client in [*(clients or {}).values(), *pending.values()]:
            try:
                client.close()
            except ReplayError as exc:
                errors.append(exc)
        for executor in (pool, probes):
            if executor is not None:
                executor.shutdown(wait=False)  # a probe in flight ends at its deadline
        if errors:
            raise errors[0]


def _same_index(first: str, second: str, shard: int) -> ShardingError:
    return ShardingError(
        f"servers {first} and {second} both report shard {shard}: each server of a sharded "
        f"replay needs its own [server] shard index (shard = \"auto\" takes it from a "
        f"StatefulSet pod's ordinal)")
