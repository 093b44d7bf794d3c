"""``ShardedClient``: one logical replay over many replay servers (shards).

``ReplayClient([...])`` and ``ReplayClient("shards://name:port")`` return one
(see :mod:`replay_client.sharded.discovery` for the addresses). It is a layer
over one-server clients (:class:`~replay_client.server_client.ServerClient`),
which never import it. It offers the calls of
a one-server client; what each does over shards:

* ``insert``: rows go to one shard per episode, or whole to the next shard in
  turn (:mod:`replay_client.sharded.placement`); ids come back in row order.
* ``sample``: one batch from the union of all shards, drawn exactly as one
  table holding every row would draw it (:mod:`replay_client.sharded.merge`).
* ``update_priorities``: each id goes to its shard (``id >> 56``), one call per
  shard, concurrently; stale ids are ignored per shard, as on one server.
* ``delete``: each id to its shard, as ``update_priorities``. Queue tables
  (``fifo``, ``lifo``) keep their order per server, so they are not sampled
  over shards (:class:`UnsupportedError`).
* ``info``: each table summed over shards; ``shard_info``: per shard.
* ``checkpoint``, ``reset``: on every shard (``checkpoint`` returns each path).
* ``publish``, ``fetch``: variables live on the shard with the lowest index.
* ``writer``: a :class:`~replay_client.writer.Writer` whose episodes each stay
  on one shard (placed by the episode id it adds).
* ``stream``: a learner's stream whose batches are merged samples, with the
  one-server stream's prefetch bound and delivery (:mod:`replay_client.sharded.stream`).

Shards are identified by the ``shard`` index each server reports (its
``[server] shard``, ``"auto"`` on a StatefulSet), never by address order; two
servers reporting the same index are refused (:class:`ShardingError`). Every
table must have the same sampler, alpha, beta, slice_len and episode key on
every shard. A call that fails on a shard raises the shard's error, its
message naming the shard and its address.

Thread-safety: safe to share between threads, like a one-server client. It connects
lazily, pickles as its settings (a resolver must be picklable), and calls shards
concurrently on a small thread pool (one thread per shard); an insert that reaches one
shard only runs on the caller's thread (:mod:`replay_client.sharded.lanes`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from replay_client.arguments import check_int, id_array, update_arrays
from replay_client.connection import CLIENT_TIMEOUT
from replay_client.errors import (
    DeadlineExceededError,
    EmptyTableError,
    InvalidArgumentError,
    ReplayError,
    ShardingError,
    UnavailableError,
    UnknownTableError,
    UnsupportedError,
)
from replay_client.server_client import ServerClient
from replay_client.sharded.deadline import DEFAULT_SHARD_DEADLINE_S
from replay_client.sharded.discovery import Resolver, addresses_of, is_sharded
from replay_client.sharded.health import ShardStats, down_note
from replay_client.sharded.merge import MassBook, merge, shares, split
from replay_client.sharded.placement import RoundRobin, by_episode
from replay_client.sharded.routing import by_owner, calling
from replay_client.sharded.settings import ShardedSettings
from replay_client.sharded.shard_set import ShardSet
from replay_client.sharded.stream import open_stream
from replay_client.sharded.table_rows import ShardedTableRows
from replay_client.sharded.tables import TableShape, summed_tables
from replay_client.stream_options import stream_options
from replay_client.table_info import tables_of
from replay_client.vector_writer import vector_writer
from replay_client.writer import Writer
from replay_feed.credits import PriorityUpdate
from replay_feed.eager import runs_eagerly
from replay_feed.options import StreamOptions
from replay_feed.stream import BatchStream
from replay_proto.batch import SampleBatch
from replay_proto.keys import unflatten
from replay_proto.mass import SamplingMass
from replay_proto.rows import rows_of
from replay_proto.v1 import replay_pb2 as pb

__all__ = ["ShardedClient", "is_sharded"]

DEFAULT_RESOLVE_INTERVAL_S = 30.0
"""How often a ``shards://`` name is resolved again (``resolve_interval_s``)."""

_MASS_CHECK_S = 1.0  # how long a stream's check of a shard's mass may take
_EMPTY_WAIT_S = (0.01, 0.5)  # polling interval of a sample waiting for data on any shard
_RACES = 3  # splits a sample retries when a shard it drew from turned out empty


class ShardedClient(ShardedTableRows):
    """One logical replay over many servers. See the module docstring.

    Args:
        address: a list of ``host:port`` (one per shard), ``"shards://NAME:PORT"``
            (``?expected=N``: the replay has N shards) or ``"ray://NAMESPACE/NAME"``
            (a replay on Ray, :mod:`replay_client.sharded.discovery`).
        client: makes each shard's one-server client from its address and
            options (default: :class:`~replay_client.server_client.ServerClient`).
        resolver: resolves a ``shards://`` name (default: the system's resolver).
        seed: seeds the client's own randomness (the split of a batch across
            shards and the shuffle of its parts); ``None``: fresh entropy.
        allow_degraded: go on without shards that are unavailable (see
            :mod:`replay_client.sharded.health`): samples from the live shards,
            inserts to them, updates of a down shard's ids skipped; a down
            shard is tried again after a backoff and rejoins when it answers.
            ``False``: such a call fails with :class:`UnavailableError` naming
            the shard. With it, each shard's client retries an unavailable
            server for at most ``max_retry_s`` = 0.5 s unless given.
        **options: given to every shard's client (``timeout``, ``token``,
            ``tls``, ``max_message_mb``, ``max_retry_s``, ``allow_plaintext_token``).
        resolve_interval_s: how often a ``shards://`` name is resolved again
            (``None``: only after a shard was found unavailable); servers that
            appear join, addresses that disappear are down shards
            (:mod:`replay_client.sharded.shard_set`).
        wait_for_shards_s: where the name says how many shards there are, how
            long a strict client waits for missing ones before it refuses
            (naming them); a degraded client goes on and lists them in
            ``missing_shards``.
        shard_deadline_s: how long a shard has to answer its part of a call
            before it is probed, and the probe after that: a shard silent past
            both is unavailable (:mod:`replay_client.sharded.deadline`).
    """

    def __init__(self, address: Any, *, client: Callable[..., Any] = ServerClient,
                 resolver: Resolver | None = None, seed: int | None = None,
                 allow_degraded: bool = False,
                 resolve_interval_s: float | None = DEFAULT_RESOLVE_INTERVAL_S,
                 wait_for_shards_s: float = 10.0,
                 shard_deadline_s: float = DEFAULT_SHARD_DEADLINE_S, **options: Any) -> None:
        if isinstance(address, (list, tuple)):
            address = list(address)
            addresses_of(address)  # bad lists fail here, before any connection
        self._start(ShardedSettings(address, client, resolver, seed, allow_degraded,
                                    resolve_interval_s, wait_for_shards_s, shard_deadline_s,
                                    options))

    def _start(self, settings: ShardedSettings) -> None:
        self._settings = settings
        self._degraded = settings.allow_degraded
        self._masses = MassBook()
        self._set = ShardSet(settings.address, settings.client, settings.shard_options,
                             resolver=settings.resolver, degraded=settings.allow_degraded,
                             resolve_interval_s=settings.resolve_interval_s,
                             forget=lambda shard: self._masses.forget(shard=shard),
                             wait_for_shards_s=settings.wait_for_shards_s,
                             shard_deadline_s=settings.shard_deadline_s)
        self._health = self._set.health
        self._tables: dict[str, TableShape] = {}
        self._rng = np.random.default_rng(settings.seed)
        self._rng_lock = threading.Lock()
        self._turns = RoundRobin()

    # ------------------------------------------------------------ connection

    @property
    def address(self) -> Any:
        """The addresses as given (a list, or the ``shards://`` name)."""
        return self._set.spec

    @property
    def timeout(self) -> float | None:
        return self._settings.options.get("timeout", 30.0)

    @property
    def shards(self) -> dict[int, str]:
        """Shard index -> address, in index order (connects on first use)."""
        return self._set.addresses

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": replace(self._settings, address=self._set.spec)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._start(state["settings"])

    def close(self) -> None:
        """Send pending ``wait=False`` updates and close every shard's connection."""
        self._set.close()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> dict[int, Any]:
        """Shard index -> one-server client (found on first use, followed after)."""
        return self._set.clients()

    def _each(self, calls: Mapping[int, Callable[[Any], Any]],
              tolerate: bool = False, inline: bool = False) -> dict[int, Any]:
        return self._set.each(calls, tolerate, inline)

    def _live(self, clients: Iterable[int]) -> list[int]:
        return self._set.live(clients)

    def _all(self, call: Callable[[Any], Any], tolerate: bool = False) -> dict[int, Any]:
        return self._set.all(call, tolerate)

    def shard_stats(self) -> ShardStats:
        """What degraded mode did: shards down now, failures, rejoins, degraded calls."""
        return self._health.stats()

    # ---------------------------------------------------------------- tables

    def _shape(self, table: str) -> TableShape:
        """The table's shape, checked equal on every shard (one ``info`` round the first time)."""
        shape = self._tables.get(table)
        if shape is None:
            self._refresh(table, self._live(self._connect()))
            shape = self._tables.get(table)
            if shape is None:
                raise UnavailableError(f"no shard answered for table {table!r} "
                                       f"(down: {self._health.stats().down})")
        return shape

    def _refresh(self, table: str, shards: list[int]) -> dict[int, SamplingMass]:
        """Ask ``shards`` for ``table``'s info; note its shape and their masses."""
        infos = self._each({s: (lambda c: c.info()) for s in shards}, tolerate=True)
        masses = {}
        for shard, tables in infos.items():
            info = tables.get(table)
            if info is None:
                raise UnknownTableError(f"shard {shard} ({self._set.address_of(shard)}) has no table "
                                        f"named {table!r}; tables there: {', '.join(sorted(tables))}")
            shape = TableShape.of(info)
            known = self._tables.setdefault(table, shape)
            if known != shape:
                raise ShardingError(f"table {table!r} differs between shards: {known} on one, "
                                    f"{shape} on shard {shard} ({self._set.address_of(shard)})")
            if info.mass is not None:
                masses[shard] = info.mass
                self._masses.put(table, shard, info.mass)
        return masses

    # ------------------------------------------------------------------ insert

    @runs_eagerly
    def insert(self, table: str, data: Any, priorities: Any = None) -> torch.Tensor:
        """Append rows; each episode's rows go to one shard (see :mod:`replay_client.sharded.placement`).

        Returns the rows' ids in the order of the rows. An insert spanning
        shards is one insert per shard, sent concurrently: if one fails, the
        others' rows may be stored (the error names the failed shard). In
        degraded mode rows go to live shards only, and rows whose shard
        failed are resent to the others (an insert in flight when its shard
        died may then be stored twice).
        """
        clients = self._connect()
        shape = self._shape(table)
        flat = rows_of(data) if shape.by_episode or _has_key(data, shape.episode_key) else None
        column = None if flat is None else flat.get(shape.episode_key)
        episodes = None if column is None else np.asarray(column).reshape(-1).astype(np.int64)
        prios = None if priorities is None else torch.as_tensor(np.asarray(priorities))
        ids = None if episodes is None else torch.empty(episodes.size, dtype=torch.int64)
        pending = None if episodes is None else np.arange(episodes.size)
        excluded: set[int] = set()
        while True:
            order = [s for s in self._live(clients) if s not in excluded]
            if not order:
                raise UnavailableError(f"no shard could take the insert into {table!r} "
                                       f"(down: {self._health.stats().down})")
            if len(order) < len(clients):
                self._health.count("degraded_inserts")
            if episodes is None or pending is None:
                plan: dict[int, np.ndarray | None] = {self._turns.next(order): None}
            else:
                plan = {s: pending[rows] for s, rows in by_episode(episodes[pending], order).items()}
                if len(plan) == 1 and len(pending) == episodes.size:
                    plan = dict.fromkeys(plan)  # every row to one shard: send the data as given

            def part(rows: np.ndarray | None) -> Callable[[Any], Any]:
                if rows is None:
                    return lambda c: c.insert(table, data, priorities)
                assert flat is not None
                picked = unflatten({k: v[rows] for k, v in flat.items()})
                return lambda c: c.insert(table, picked, None if prios is None else prios[rows])

            results = self._each({s: part(rows) for s, rows in plan.items()}, tolerate=True,
                                 inline=True)
            for shard, rows in plan.items():
                if shard in results:
                    if rows is None:
                        return results[shard]
                    assert ids is not None
                    ids[torch.from_numpy(rows)] = results[shard]
            failed = [s for s in plan if s not in results]
            if not failed:
                assert ids is not None
                return ids
            excluded.update(failed)
            if ids is not None:
                pending = np.concatenate([plan[s] if plan[s] is not None
                                          else np.arange(len(ids)) for s in failed])

    def writer(self, table: str, **options: Any) -> Writer:
        """A :class:`~replay_client.writer.Writer` on ``table``: each episode stays on one shard.

        Its rows carry its episode id (``episode_key``, the table's by
        default), by which they are placed; ``episode_key=None`` is refused
        (its rows could not be kept together).
        """
        shape = self._shape(table)
        key = options.setdefault("episode_key", shape.episode_key)
        if key is None:
            raise InvalidArgumentError("a sharded client's writer needs an episode_key: episodes "
                                       "are kept on one shard by their id")
        return Writer(self, table, **options)

    vector_writer = vector_writer  # a vector env's steps, one episode per sub-env

    # ------------------------------------------------------------------ sample

    @runs_eagerly
    def sample(self, table: str, batch_size: int, *, wait: bool | None = None,
               timeout: Any = CLIENT_TIMEOUT) -> SampleBatch:
        """One batch from the union of every shard, as one table would draw it.

        The batch is split across shards by the masses they last reported,
        drawn concurrently, and merged (:mod:`replay_client.sharded.merge` states what
        is exact and the staleness bound). ``wait``: while no shard has
        anything to sample, wait (polling the shards' masses) up to the
        timeout. Shards that get no draw report their mass in the same round.

        Raises:
            EmptyTableError: no shard has anything to sample (``wait=False``).
            DeadlineExceededError: ``wait=True`` and nothing came within the timeout.
        """
        check_int("batch_size", batch_size, 1)
        clients = self._connect()
        shape = self._shape(table)
        if not shape.mergeable:
            raise UnsupportedError(
                f"table {table!r} ({shape.sampler}) is a queue: its order is kept per server, "
                f"so a sharded client does not sample it; use one client per shard")
        limit = self.timeout if timeout is CLIENT_TIMEOUT else timeout
        deadline = None if limit is None else time.monotonic() + limit
        pause = _EMPTY_WAIT_S[0]
        raced = 0
        while True:
            live, masses = self._live_masses(table, clients)
            with self._rng_lock:
                try:
                    counts = split(batch_size, masses, self._rng)
                except ValueError:
                    counts = None
            if counts is None:
                masses = self._refresh(table, live)
                if any(m.total > 0 for m in masses.values()):
                    continue
                self._may_wait(table, clients, live, wait, deadline, pause, limit)
                time.sleep(pause)
                pause = min(2 * pause, _EMPTY_WAIT_S[1])
                continue
            try:
                missing = {s for s in clients if s not in masses} | set(self._set.absent)
                batch = self._draw(table, shape, counts, masses, wait, timeout,
                                   tuple(sorted(missing)))
                if batch is not None:
                    return batch
            except EmptyTableError:
                raced += 1  # a shard emptied (reset) since it reported its mass: split again
                if raced >= _RACES:
                    raise

    def _live_masses(self, table: str, clients: Iterable[int]
                     ) -> tuple[list[int], dict[int, SamplingMass]]:
        """The live shards and the masses they last reported (asked now of those never asked)."""
        live = self._live(clients)
        masses = {s: m for s, m in self._masses.get(table).items() if s in live}
        unknown = [s for s in live if s not in masses]
        if unknown:
            masses.update(self._refresh(table, unknown))
            live = self._live(live)
            masses = {s: m for s, m in masses.items() if s in live}
        return live, masses

    def _may_wait(self, table: str, clients: Iterable[int], live: list[int], wait: bool | None,
                  deadline: float | None, pause: float, limit: Any) -> None:
        """Raise what a sample that found nothing on any live shard raises, unless it may pause
        ``pause`` s and look again: with ``wait``, until ``deadline`` (monotonic; ``None``: for
        ever; ``limit``: the timeout it came from).

        Raises:
            EmptyTableError: not ``wait``.
            DeadlineExceededError: the pause would end past ``deadline``.
        """
        down = down_note(set(clients) - set(live) | set(self._set.absent))
        if not wait:
            raise EmptyTableError(f"table {table!r} has nothing to sample on any of its "
                                  f"{len(live)} live shards{down}")
        if deadline is not None and time.monotonic() + pause > deadline:
            raise DeadlineExceededError(f"table {table!r} had nothing to sample on any of its "
                                        f"{len(live)} live shards within {limit} s{down}")

    def _draw(self, table: str, shape: TableShape, counts: dict[int, int],
              masses: dict[int, SamplingMass], wait: bool | None, timeout: Any,
              missing: tuple[int, ...]) -> SampleBatch | None:
        """One round: sample ``counts`` from their shards, refresh the others' masses, merge.

        ``None``: a shard failed in degraded mode (it is down now): draw again without it.
        """
        drawn = {s: k for s, k in counts.items() if k > 0}

        def draw(k: int) -> Callable[[Any], Any]:
            return lambda c: c.sample(table, k, wait=wait, timeout=timeout)

        calls: dict[int, Callable[[Any], Any]] = {s: draw(k) for s, k in drawn.items()}
        others = [s for s in masses if s not in drawn]  # an empty shard may have filled since
        for shard in others:
            calls[shard] = lambda c: c.info()[table].mass
        try:
            results = self._each(calls, tolerate=True)
        except EmptyTableError:
            for shard in drawn:  # one of them emptied since its report: ask again
                self._masses.forget(table, shard)
            raise
        if len(results) < len(calls):
            return None
        if missing:
            self._health.count("degraded_samples")
        fresh = dict(masses)
        for shard, result in results.items():
            mass = result.mass if shard in drawn else result
            if mass is not None:
                fresh[shard] = mass
                self._masses.put(table, shard, mass)
        q = shares(masses)
        if len(drawn) == 1 and sum(1 for v in q.values() if v > 0) == 1 and not missing:
            return results[next(iter(drawn))]  # one shard holds everything: its batch is exact
        with self._rng_lock:
            return merge({s: results[s] for s in drawn}, q, fresh,
                         shape.beta if shape.prioritized else None, self._rng, missing)

    # -------------------------------------------------------------- priorities

    @runs_eagerly
    def update_priorities(self, table: str, ids: Any, priorities: Any, *,
                          wait: bool = True) -> int | None:
        """Set priorities by id: each id goes to its shard (``id >> 56``), concurrently.

        Checked whole before anything is sent (a bad priority or an id of no
        known shard refuses the whole update; in degraded mode, while a server
        has not answered yet or an expected shard is missing, ids of no known
        shard, or of the missing one, are skipped and counted instead). Returns how many ids named stored rows, summed over shards
        (``None`` with ``wait=False``).

        Raises:
            InvalidIdsError: an id is negative or belongs to no shard of this client.
            InvalidPriorityError, NoPrioritiesError, UnknownTableError, ...
        """
        id_array, values = (a.reshape(-1) for a in update_arrays(ids, priorities))  # slices whole
        clients = self._connect()
        sendable = self._set.sendable(id_array, clients)
        if sendable is not None:
            id_array, values = id_array[sendable], values[sendable]
        groups = self._set.owners(id_array, clients, "nothing was updated")
        live = set(self._live(clients))
        for shard in [s for s in groups if s not in live]:  # degraded: that shard is down
            self._health.count("skipped_updates", len(groups.pop(shard)))

        def send(rows: np.ndarray) -> Callable[[Any], Any]:
            return lambda c: c.update_priorities(table, id_array[rows], values[rows], wait=wait)

        results = self._each({s: send(rows) for s, rows in groups.items()}, tolerate=True)
        for shard in [s for s in groups if s not in results]:
            self._health.count("skipped_updates", len(groups[shard]))
        return None if not wait else sum(int(r) for r in results.values())

    @runs_eagerly
    def delete(self, table: str, ids: Any) -> int:
        """Remove rows by id from a queue table, each id on its shard, concurrently: how many
        named rows present (summed). An id of no known shard deletes nothing (InvalidIdsError)."""
        array = id_array(ids).reshape(-1)
        groups = by_owner(array, self._connect(), "nothing was deleted")
        results = self._each({s: calling("delete", table, array[rows])
                              for s, rows in groups.items()})
        return sum(int(r) for r in results.values())

    def flush_updates(self, timeout: float | None = None) -> None:
        """Wait until every ``wait=False`` update reached its shard (or raise its error)."""
        self._all(lambda c: c.flush_updates(timeout))

    # ------------------------------------------------------------------- admin

    @runs_eagerly
    def info(self) -> dict[str, Any]:
        """Every table summed over shards (sizes, counters, masses); per shard: :meth:`shard_info`."""
        return summed_tables(self._all(lambda c: c.info(), tolerate=True))

    def shard_info(self) -> dict[int, Any]:
        """Each shard's ``ServerInfo`` (its shard, incarnation, limits, tables), by shard index."""
        return self._all(lambda c: c.server_info(), tolerate=True)

    @runs_eagerly
    def server_info(self) -> Any:
        raise UnsupportedError("a sharded client talks to many servers: shard_info() gives each "
                               "one's ServerInfo, info() the tables summed over shards")

    def checkpoint(self, *, timeout: float | None = 600.0) -> dict[int, str]:
        """Have every shard write a checkpoint (concurrently); each one's path, by shard.

        Each shard's checkpoint holds every row it acknowledged before the
        call; the shards' checkpoints are not one atomic cut.
        """
        return self._all(lambda c: c.checkpoint(timeout=timeout))

    def ack(self, table: str) -> None:
        """Refuse: a sharded client takes no lease, since it does not sample queues.

        A no-op for other tables, as ``ReplayClient.ack`` (nothing is leased).

        Raises:
            UnsupportedError: ``table`` is a queue (``fifo``/``lifo``): sample and
                acknowledge it with one client per shard.
        """
        if not self._shape(table).mergeable:
            raise UnsupportedError(
                f"table {table!r} is a queue: a sharded client does not sample it, so it holds "
                f"no lease to acknowledge; sample and ack with one client per shard")

    def reset(self, table: str, *, schema: bool = False) -> None:
        """Remove every row of ``table`` on every shard (``schema``: see ``ReplayClient.reset``)."""
        self._all(lambda c: c.reset(table, schema=schema))
        self._masses.forget(table)

    @property
    def variables_shard(self) -> int:
        """The shard that holds named variables: the lowest index."""
        return next(iter(self._connect()))

    def publish(self, name: str, state_dict: Any) -> int:
        """Store a variable on :attr:`variables_shard` (see ``ReplayClient.publish``)."""
        shard = self.variables_shard
        return self._each({shard: lambda c: c.publish(name, state_dict)})[shard]

    def fetch(self, name: str, newer_than: int | None = None,
              timeout: float | None = None) -> Any:
        """Read a variable from :attr:`variables_shard` (see ``ReplayClient.fetch``)."""
        shard = self.variables_shard
        return self._each({shard: lambda c: c.fetch(name, newer_than, timeout)})[shard]

    def stream(self, table: str, batch_size: int, options: StreamOptions | None = None,
               **keywords: Any) -> BatchStream:
        """A learner's stream of merged batches: a ``SampleStream`` per shard, merged exactly
        (see :mod:`replay_client.sharded.stream`); options as ``ServerClient.stream`` (one
        :class:`~replay_feed.options.StreamOptions`).

        Raises:
            InvalidArgumentError: a bad option, before any network call.
            UnsupportedError: a queue table (its order is kept per server).
        """
        check_int("batch_size", batch_size, 1)
        opts = stream_options(options, keywords)
        clients = self._connect()
        shape = self._shape(table)  # an unknown or inconsistent table fails here
        if not shape.mergeable:
            raise UnsupportedError(
                f"table {table!r} ({shape.sampler}) is a queue: its order is kept per server, "
                f"so a sharded client does not stream it; use one client per shard")
        live = self._live(clients)
        masses = self._refresh(table, live)
        def check(ids: Any, priorities: Any) -> PriorityUpdate:
            id_values, values = update_arrays(ids, priorities)
            by_owner(id_values, self._set.known, "nothing was queued")
            return PriorityUpdate(id_values, values)

        def refresh(shard: int) -> SamplingMass | None:  # once, briefly: the stream waits on it
            connection = self._set.clients()[shard].connection
            try:
                raw = connection.unary("Info", pb.InfoRequest().SerializeToString(),
                                       retry=False, retry_unsent=False, timeout=_MASS_CHECK_S)
            except ReplayError:
                return None
            info = tables_of(pb.InfoResponse.FromString(raw)).get(table)
            return None if info is None else info.mass

        return open_stream(self._set.clients, lambda: self._set.addresses, table, batch_size, opts,
                           beta=shape.beta if shape.prioritized else None, masses=masses,
                           refresh=refresh, generator=self._rng,
                           rng_lock=self._rng_lock, health=self._health,
                           degraded=self._degraded, check_update=check,
                           absent=lambda: self._set.absent)


def _has_key(data: Any, key: str) -> bool:
    try:
        return key in data.keys()
    except (AttributeError, TypeError):
        return False
