"""A learner's stream over shards: one ``SampleStream`` per shard, merged into exact batches.

:class:`MergedLink` is the sharded stream's :class:`~replay_feed.link.Link`,
run by the same skeleton as every stream
(:class:`~replay_feed.source.LinkSource`): the learner's credits bound how
many merged batches are made ahead, exactly as on one server. Underneath,
each shard streams chunks of iid draws with its own credit window
(:mod:`replay_client.sharded.rows`: gRPC, or shared memory for a shard on
this host). Each merged batch is one exact merged sample
(:mod:`replay_client.sharded.merge`): its ``batch_size`` draws split across
the shards multinomially by the masses they last reported (every chunk
carries its shard's mass), that many rows taken from each shard's chunks,
written once into the learner's staging buffer (shuffled together when
several shards gave rows), with one table's probabilities and importance
weights. So a streamed batch is distributed as a sampled one.

Small batches are merged several per pass (as a server draws several per
message for the plain stream, :mod:`replay_client.grouping`): once the
first batch's size is known, up to ``k`` batches are made each time the
merge wakes, while their rows are there, and the learner's window widens to
``2 k`` (unless it gave ``prefetch``). Each batch of a pass is its own
multinomial split of ``batch_size`` draws, all from the masses of the pass
(:func:`~replay_client.sharded.merge.split_more`: one call), and the pass is
merged at once (:func:`~replay_client.sharded.merge.merge_group`: a small
batch's merge is all fixed costs, so they are paid once a pass). Each
shard's stream groups its chunks by the rows one server's message would carry
(``n`` shards: ``8 n`` chunks of a ``1/n`` share), so shards cost their
servers no more messages than one server; their credits go back a group at a
time too (:class:`~replay_client.sharded.rows.ShardRows`).

Copies per batch: the server's gather (into the ring slot, or into its
batch) and, over gRPC, its encoding; the merge's one copy into the
learner's (pinned) staging buffer; the device copy. Four at most, three on
shared memory.

Priority updates the learner hands the stream (``stream.update_priorities``)
go, each id to its shard (``id >> 56``), on that shard's stream, before its
next credit: every row that shard draws afterwards sees them; rows it drew
before (up to its window of chunks) were drawn with the old priorities, as
on one server a prefetched batch is.

Faults: a shard whose stream is lost reconnects (``reconnect``) within its
client's ``max_retry_s``. Past that, by default the stream ends with the
shard's error, naming it; with ``allow_degraded=True`` the shard is left out
(``batch.missing_shards``; the merge is exact over the live shards) and
tried again on :class:`~replay_client.sharded.health.ShardHealth`'s
schedule (each try a new stream that fails at once until the shard answers:
one warning per outage, when the shard is left out, and one line when it is
back, however many tries a restart takes). In degraded mode a shard that
delivers none of the rows a batch waits for within :data:`STALL_S` seconds is
left out too, until it delivers again.

Waiting: while no shard has anything to sample, the stream waits (every
shard's server holds its draw until rows arrive) up to ``wait_timeout`` per
batch; ``wait=False`` ends it with :class:`EmptyTableError` instead.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from replay_client import grouping
from replay_client.errors import (
    DeadlineExceededError,
    EmptyTableError,
    ReplayError,
    ShardingError,
)
from replay_client.sharded.discovery import named
from replay_client.sharded.health import ShardHealth
from replay_client.sharded.merge import merge_group, merge_into, shares, split, split_more
from replay_client.sharded.rows import ShardRows
from replay_client.stream import StagingTarget
from replay_client.stream_options import feed_core, reconnect_window
from replay_feed.credits import CreditFlow, PriorityUpdate
from replay_feed.link import apply_until_stopping, drawn_here
from replay_feed.options import StreamOptions
from replay_feed.source import LinkSource
from replay_feed.stream import BatchStream
from replay_proto.batch import SampleBatch
from replay_proto.id_layout import shard_of
from replay_proto.mass import SamplingMass

log = logging.getLogger("replay_client")

STALL_S = 2.0
"""Degraded mode: how long a batch waits for a shard's rows before it leaves the shard out."""

FOLLOW_S = 1.0
"""How often the stream looks for shards that joined the client's set."""

RECHECK_S = 1.0
"""How long a batch waits for a shard's rows before asking the shard for its mass (a shard
emptied since its last chunk, by a reset, draws nothing until rows arrive: split again)."""

_Drawn = tuple[dict[int, tuple[list[SampleBatch], list]], dict[int, float],
               dict[int, SamplingMass], tuple[int, ...], dict[int, np.ndarray] | None]
"""One pass's draw: each shard's pieces and hold, the shares, the masses, the shards left
out, and (several batches drawn together) each shard's rows per batch."""

ShardFactory = Callable[..., ShardRows]
"""``make(shard, cond)``: a new (not started) :class:`ShardRows` for ``shard``;
``make(shard, cond, probe=True)`` for a left-out shard tried again."""


class MergedLink:
    """Merged batches from every shard's stream (see the module docstring).

    Args:
        shards: the shards' indices and addresses now (a shard that joins the
            set while the stream runs joins the stream; asked once a second).
        make: builds a shard's :class:`ShardRows` (again, after it failed).
        batch_size: draws per merged batch.
        beta: the table's importance exponent (``None``: not prioritized).
        masses: each shard's mass when the stream opened.
        staging: the feed's staging buffers of batch ``k``.
        when_released: ``when_released(k, fn)`` calls ``fn`` once the learner gave batch
            ``k`` back (the feed's hook).
        copy: the feed's row copier (contiguous copies split across cores).
        generator: the split's and shuffle's randomness (its own lock is ``rng_lock``).
        refresh: asks a shard for the table's mass now (``None``: no answer).
        health: the sharded client's record of down shards.
        degraded: leave failed or stalled shards out instead of failing.
        wait: wait while no shard has anything to sample.
        wait_timeout: seconds one batch may wait for data (``None``: no limit).
        group: merged batches made per pass at most (``None``: chosen from the first
            batch's size, :func:`replay_client.grouping.choose`; small batches: up to 8).
        prefetch: the window the learner asked for (``None``: widened for small batches).
        notes: the stream's notes (the grouping chosen is added).
        absent: the shards the client expects but has not found (listed in every
            batch's ``missing_shards``).
    """

    transport = "sharded"

    def __init__(self, shards: Callable[[], Mapping[int, str]], make: ShardFactory,
                 batch_size: int, *,
                 beta: float | None, masses: Mapping[int, SamplingMass],
                 staging: Callable[[int, Any], list[torch.Tensor]],
                 when_released: Callable[[int, Callable[[], None]], None],
                 copy: Callable[[torch.Tensor, int, torch.Tensor], None],
                 generator: np.random.Generator, rng_lock: threading.Lock,
                 refresh: Callable[[int], SamplingMass | None],
                 health: ShardHealth, degraded: bool, wait: bool,
                 wait_timeout: float | None, group: int | None = None,
                 prefetch: int | None = None, notes: list[str] | None = None,
                 absent: Callable[[], tuple[int, ...]] = tuple) -> None:
        self._shards = shards
        self._addresses = dict(shards())
        self._followed = time.monotonic()
        self._make = make
        self._batch_size = batch_size
        self._beta = beta
        self._staging = staging
        self._when_released = when_released
        self._copy = copy
        self._rng = generator
        self._rng_lock = rng_lock
        self._refresh = refresh
        self._health = health
        self._degraded = degraded
        self._wait = wait
        self._wait_timeout = wait_timeout
        self._group = group
        self._prefetch = prefetch
        self._notes = notes if notes is not None else []
        self._absent = absent
        self._cond = threading.Condition()
        self._stopped = False
        self._rows: dict[int, ShardRows] = {}
        self._down: dict[int, float] = {}  # shard -> when it was left out (degraded)
        self._outages: set[int] = set()  # left out, not delivered since (logged once)
        self._stalled: dict[int, int] = {}  # shard -> its arrivals when it was left out
        self._initial = dict(masses)
        self._keys: list[str] | None = None
        self._flow: CreditFlow | None = None
        self._learner_window = 0

    # ------------------------------------------------------------ the call

    def call(self, flow: CreditFlow, credits: int, updates: list[PriorityUpdate],
             remaining: int, first: int) -> Iterator[SampleBatch]:
        with self._cond:
            for shard in self._addresses:
                if shard not in self._rows and not self._stopped:
                    self._start(shard)
        self._flow = flow
        self._learner_window = flow.window
        return drawn_here(flow, credits, updates, remaining, first, apply=self._route,
                          draw=lambda k: next(iter(self._merged(k, 1)), None),
                          stopped=lambda: self._stopped,
                          draw_group=self._merged)

    def may_grow(self) -> bool:
        """Whether the learner's window may widen now: not while a shard reads a shared-memory
        ring (its slots are fixed, so its chunks could not follow, and a merge would wait for
        rows that only the learner's batches, given back after it, could free)."""
        with self._cond:
            return all(rows.link.transport == "grpc" for rows in self._rows.values())

    def _widen(self) -> None:
        """The learner's window grew (over a slow link): the shards' windows follow."""
        flow = self._flow
        if flow is None or flow.window <= self._learner_window:
            return
        grown, self._learner_window = flow.window - self._learner_window, flow.window
        with self._cond:
            for rows in self._rows.values():
                rows.grow(-(-grown * self._batch_size // rows.chunk_rows))

    def _start(self, shard: int, probe: bool = False) -> None:
        rows = self._make(shard, self._cond, probe=True) if probe else self._make(shard, self._cond)
        if rows.mass is None:
            rows.mass = self._initial.get(shard)
        self._rows[shard] = rows
        rows.start()

    def _route(self, updates: list[PriorityUpdate]) -> None:
        """Each id of ``updates`` to its shard's stream (a down shard's are dropped, counted)."""
        for update in updates:
            owners = shard_of(update.ids)
            for shard in np.unique(owners).tolist():
                mask = owners == shard
                rows = self._rows.get(shard)
                if rows is None or shard in self._down:
                    self._health.count("skipped_updates", int(mask.sum()))
                    continue
                rows.update(PriorityUpdate(update.ids[mask], update.priorities[mask]))

    # ------------------------------------------------------------ one merged batch

    def _follow(self) -> None:
        """Start a stream for each shard that joined the set (at most once a second)."""
        now = time.monotonic()
        if now - self._followed < FOLLOW_S:
            return
        self._followed = now
        try:
            current = dict(self._shards())
        except ReplayError:
            return  # the set could not be resolved now: go on with the shards we have
        with self._cond:
            for shard in [s for s in self._rows if s not in current]:  # retired: scaled down
                retired = self._rows.pop(shard)
                retired.stop()
                for kept in (self._addresses, self._down, self._stalled):
                    kept.pop(shard, None)
                self._outages.discard(shard)
            self._addresses.update(current)
            for shard in current:
                if shard not in self._rows and not self._stopped:
                    self._start(shard)

    def _merged(self, index: int, count: int) -> list[SampleBatch]:
        """Merged batches ``index, index + 1, ...``: at least one (waiting for it), at most
        ``count`` and the group size; later ones only while every shard has their rows now
        (``[]``: stopped). Each batch is its own split (one draw); the rest of a pass is
        split from the first one's masses and merged with it (:meth:`_rest_of_pass`)."""
        started = time.monotonic()
        self._follow()
        self._widen()
        most = max(1, min(count, self._group or 1))
        drawn: list[_Drawn] = []
        made = 0
        with self._cond:
            while not self._stopped and made < most:
                self._rejoin()
                live = [s for s in self._rows if s not in self._down]
                masses = {s: m for s in live if (m := self._rows[s].mass) is not None}
                with self._rng_lock:
                    try:
                        counts = split(self._batch_size, masses, self._rng)
                    except ShardingError:
                        raise  # a shard's mass no table can have: refused, naming it
                    except ValueError:
                        counts = None
                if drawn and (counts is None or any(
                        k > self._rows[s].available for s, k in counts.items())):
                    break  # a later batch of the pass waits for nothing: the next pass's turn
                if counts is None:
                    self._wait_for_data(started, live)
                    continue
                if not self._wait_for_rows(counts):
                    continue  # a shard failed or stalled and was left out: split again
                group = self._rest_of_pass(counts, masses, most) if not drawn else None
                taken = {s: self._rows[s].take(k) for s, k in counts.items() if k > 0} \
                    if group is None else \
                    {s: self._rows[s].take(int(c.sum())) for s, c in group.items() if c.sum()}
                self._back(taken)
                missing = tuple(sorted({s for s in self._addresses if s not in live}
                                       | set(self._absent())))
                size = 1 if group is None else len(next(iter(group.values())))
                if missing:
                    self._health.count("degraded_samples", size)
                drawn.append((taken, shares(masses), masses, missing, group))
                made += size
        batches: list[SampleBatch] = []
        copied = []
        for taken, q, masses, missing, group in drawn:
            pieces = {s: p for s, (p, _) in taken.items()}
            whole = self._whole(pieces, q, missing) if group is None else None
            at = index + len(batches)
            if whole is not None:  # handed over as it is: its chunk is freed when given back
                ((rows, hold),) = [(self._rows[s], h) for s, (_, h) in taken.items()]
                self._when_released(at, functools.partial(self._done, rows, hold))
                batches.append(whole)
            else:
                batches += self._write(at, pieces, q, masses, missing, group)
                copied += [(self._rows[s], hold) for s, (_, hold) in taken.items()]
        if copied:
            with self._cond:
                for rows, hold in copied:
                    rows.done(hold)
        if batches and self._group is None:
            self._choose_group(batches[0])
        return batches

    def _choose_group(self, batch: SampleBatch) -> None:
        """Small batches: merge several per pass and widen the learner's window to two
        passes, as the plain stream groups them per message (:mod:`replay_client.grouping`)."""
        nbytes = sum(t.numel() * t.element_size() for t in batch.tensors())
        chosen = grouping.choose(nbytes, self._prefetch)
        self._group = chosen.batches_per_message
        if self._group <= 1:
            return
        flow = self._flow
        if (self._prefetch is None and flow is not None and chosen.prefetch > flow.window
                and self.may_grow()):
            flow.grow(chosen.prefetch - flow.window)
        self._notes.append(f"{self._group} merged batches per pass for {nbytes / 1024:.0f} KiB "
                           f"batches (prefetch {max(chosen.prefetch, self._learner_window)}; "
                           f"see replay_client.grouping)")

    def _done(self, rows: ShardRows, hold: list) -> None:
        with self._cond:
            rows.done(hold)

    def _whole(self, pieces: dict[int, list[SampleBatch]], q: dict[int, float],
               missing: tuple[int, ...]) -> SampleBatch | None:
        """The batch as it arrived, when one shard holds all the mass and one piece of its
        (a ring slot, or rows of one message) is the whole batch: its probabilities and
        weights are one table's already, and its views need no copy (host batches are
        views on one server too, valid until the next one is asked for)."""
        if len(pieces) != 1 or missing:
            return None
        ((shard, parts),) = pieces.items()
        if len(parts) != 1 or q.get(shard, 0.0) != 1.0:
            return None
        return parts[0]

    def _rest_of_pass(self, counts: dict[int, int], masses: dict[int, SamplingMass],
                      most: int) -> dict[int, np.ndarray] | None:
        """The draws per shard of the pass's batches after this first one, split from the
        same masses, while every shard has their rows now (``None``: the first batch goes
        alone, as do large batches, one shard's, and passes of one). Under ``cond``."""
        if most <= 1 or sum(1 for k in counts.values() if k) < 2:
            return None
        with self._rng_lock:
            group = split_more(self._batch_size, counts, masses, most - 1,
                               {s: self._rows[s].available for s in counts}, self._rng)
        return group if len(next(iter(group.values()))) > 1 else None

    def _write(self, index: int, pieces: dict[int, list[SampleBatch]], q: dict[int, float],
               masses: dict[int, SamplingMass], missing: tuple[int, ...],
               group: dict[int, np.ndarray] | None) -> list[SampleBatch]:
        """Batch ``index`` (or the pass's batches ``index, ...`` of ``group``) merged into
        the learner's staging buffers."""
        first = next(iter(pieces.values()))[0]
        if self._keys is None:
            self._keys = list(first.columns)
        layout = tuple((t.dtype, (self._batch_size, *t.shape[1:])) for t in first.tensors())
        if group is None:
            out = self._staging(index, layout)
            with self._rng_lock:
                return [merge_into(out, self._keys, pieces, q, masses, self._beta, self._rng,
                                   missing, copy=self._copy)]
        outs = [self._staging(index + b, layout)
                for b in range(len(next(iter(group.values()))))]
        with self._rng_lock:
            return merge_group(outs, self._keys, pieces, group, q, masses, self._beta,
                               self._rng, missing)

    def _wait_for_data(self, started: float, live: list[int]) -> None:
        """No live shard has anything to sample: wait for a shard's rows (under ``cond``)."""
        if not self._wait:
            raise EmptyTableError(f"the table has nothing to sample on any of its "
                                  f"{len(live)} live shards")
        left = None
        if self._wait_timeout is not None:
            left = started + self._wait_timeout - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"no shard had anything to sample within wait_timeout="
                    f"{self._wait_timeout} s")
        self._cond.wait(left if left is not None else 1.0)

    def _wait_for_rows(self, counts: dict[int, int]) -> bool:
        """Until every shard of ``counts`` has its rows (True), or one failed, emptied or
        (degraded) stalled and the batch must be split again (False). Under ``cond``."""
        started = time.monotonic()
        checked: set[int] = set()
        while not self._stopped:
            short = [s for s, k in counts.items() if k > self._rows[s].available]
            if not short:
                return True
            for shard in short:
                self._rows[shard].flush()  # its held-back credits go now
            now = time.monotonic()
            for shard in short:
                rows = self._rows[shard]
                if rows.error is not None or rows.ended:
                    self._lost(shard, rows)
                    return False
                if self._degraded and now - rows.last_arrival > STALL_S:
                    self._leave_out(shard, f"no rows for {STALL_S:.0f} s (stalled)")
                    self._stalled[shard] = rows.arrivals
                    return False
                if now - started > RECHECK_S and shard not in checked:
                    checked.add(shard)
                    if self._emptied(shard, rows):
                        return False
            self._cond.wait(RECHECK_S / 4)
        return False

    def _emptied(self, shard: int, rows: ShardRows) -> bool:
        """Whether ``shard`` has nothing to sample now (its mass asked, outside ``cond``)."""
        self._cond.release()
        try:
            mass = self._refresh(shard)
        finally:
            self._cond.acquire()
        if mass is not None and mass.total <= 0 and rows.available == 0:
            rows.mass = mass
            return True
        return False

    def _lost(self, shard: int, rows: ShardRows) -> None:
        """``shard``'s stream ended with an error: raise it, or (degraded) leave the shard out."""
        where = f"shard {shard} ({self._addresses.get(shard, '?')})"
        error = rows.error
        if error is None:
            error = EmptyTableError(f"{where}: its stream ended")
        if not self._degraded:
            if isinstance(error, ReplayError):
                raise named(error, where) from error
            raise error
        rows.stop()
        self._leave_out(shard, str(error))

    def _leave_out(self, shard: int, reason: str) -> None:
        self._down[shard] = time.monotonic()
        self._health.failed(shard, reason)
        if shard not in self._outages:
            self._outages.add(shard)
            log.warning("shard %d (%s) left out of the stream: %s; tried again on a backoff "
                        "(one line when it gives rows again)", shard,
                        self._addresses.get(shard, "?"), reason)

    def _back(self, taken: Mapping[int, Any]) -> None:
        """Shards of an outage that gave rows to a batch again: logged, once."""
        for shard in self._outages & set(taken):
            self._outages.discard(shard)
            log.info("shard %d (%s) is back in the stream", shard,
                     self._addresses.get(shard, "?"))

    def _rejoin(self) -> None:
        """Bring back left-out shards: a stalled one that delivered since, a failed one whose
        retry time came (a new stream). Under ``cond``."""
        for shard in list(self._down):
            rows = self._rows[shard]
            if shard in self._stalled and rows.error is None and not rows.ended:
                if rows.arrivals > self._stalled[shard]:
                    del self._down[shard], self._stalled[shard]
                    self._health.answered([shard])
                continue
            if self._health.live([shard]) and not self._stopped:
                self._stalled.pop(shard, None)
                rows.join(0.0)
                del self._down[shard]
                self._start(shard, probe=True)  # counts as rejoined once it delivers
                self._health.answered([shard])

    # ------------------------------------------------------------ lifetime

    def after_last(self, flow: CreditFlow) -> None:
        apply_until_stopping(flow, self._route)  # into the shards' streams, open till stop

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            rows = list(self._rows.values())
            self._cond.notify_all()
        for shard_rows in rows:
            shard_rows.stop()

    def close(self) -> None:
        self.stop()
        deadline = time.monotonic() + 2.0
        for rows in list(self._rows.values()):
            rows.join(max(0.0, deadline - time.monotonic()))


def chunk_rows(batch_size: int, shards: int) -> int:
    """Rows per chunk of each shard's stream: an even share of a batch."""
    return max(1, math.ceil(batch_size / max(1, shards)))


def shard_window(prefetch: int, batch_size: int, chunk: int) -> int:
    """Chunks a shard may have in flight or buffered: enough for the learner's window, the
    batch it holds and one more, were every draw to come from that shard."""
    return max(2, math.ceil((prefetch + 2) * batch_size / chunk))


def open_stream(clients: Callable[[], Mapping[int, Any]],
                addresses: Callable[[], Mapping[int, str]], table: str,
                batch_size: int, options: StreamOptions, *, beta: float | None,
                masses: Mapping[int, SamplingMass],
                refresh: Callable[[int], SamplingMass | None], generator: np.random.Generator,
                rng_lock: threading.Lock, health: ShardHealth, degraded: bool,
                check_update: Callable[[Any, Any], PriorityUpdate],
                absent: Callable[[], tuple[int, ...]] = tuple) -> BatchStream:
    """A learner's stream of merged batches over ``clients()`` (one-server clients by shard,
    asked again as the set changes; ``addresses()`` likewise).

    Raises:
        InvalidArgumentError: a bad delivery option (e.g. ``pin_memory=True`` without an accelerator).
    """
    prefetch = options.prefetch or grouping.DEFAULT_PREFETCH
    core = feed_core(prefetch, options)
    shards = len(clients())
    chunk = chunk_rows(batch_size, shards)
    window = shard_window(prefetch, batch_size, chunk)
    group = options.batches_per_message  # None: chosen per shard at its first chunk
    target = StagingTarget(None, None, core.stats, core.delivery)

    def make(shard: int, cond: threading.Condition, probe: bool = False) -> ShardRows:
        client = clients()[shard]
        # A chunk's grouping is chosen as on one server, by the rows one server's message
        # would carry (small chunks: up to 8 batches' worth per message, the shard's window
        # widened to two groups): n shards cost their servers the messages one would.
        link = client.link(table, chunk, target, batches_per_message=group, prefetch=None,
                           shared_memory=options.shared_memory and (group or 1) <= 1, wait=True,
                           most_per_message=max(1, grouping.MAX_GROUP * batch_size // chunk))
        # Strict: a shard's restart is waited for as a server's (reconnect_s). Degraded: the
        # shard client's short window, after which the merge leaves the shard out and tries it
        # again by itself (its probes).
        window_s = (client.connection.retry_window if degraded
                    else reconnect_window(options, client.connection))
        return ShardRows(shard, link, cond, window=max(window, 2 * (group or 1)),
                         chunk_rows=chunk,
                         mass=None, reconnect=options.reconnect, retry_window_s=window_s,
                         name=f"shard {shard} ({client.address})", probe=probe)

    link = MergedLink(addresses, make, batch_size, beta=beta, masses=masses,
                      staging=core.staging, when_released=core.when_released,
                      copy=core.copy_rows, generator=generator,
                      rng_lock=rng_lock, refresh=refresh, health=health, degraded=degraded,
                      wait=options.wait, wait_timeout=options.wait_timeout,
                      group=group, prefetch=options.prefetch, notes=core.stats.notes,
                      absent=absent)
    source = LinkSource(link, check_update=check_update, num_batches=options.num_batches,
                        reconnect=False, name=f"{shards} shards")
    if options.prefetch is None:  # widened over slow links; the shards' buffers take as much
        core.grow_window(options.memory_mb * 2**20 / 2, link.may_grow)
    stream = BatchStream(core, source, table)
    stream.stats.notes.append(
        f"over {shards} shards: one SampleStream each, chunks of {chunk} rows "
        f"(window {max(window, 2 * (group or 1))} chunks), merged exactly into each batch")
    return stream
