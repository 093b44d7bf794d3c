"""A learner's stream over shards: each batch one exact merged sample, with the feed's flow control.

The source runs on the stream's background thread (:class:`~replay_feed.stream.BatchStream`)
and draws batch ``k`` only while ``k < prefetch + taken`` (the same credits as
a one-server stream: at most ``prefetch`` batches in flight or buffered beside
the one the learner holds). Each batch is one
:meth:`~replay_client.sharded.client.ShardedClient.sample` round: split across
the shards by mass, drawn concurrently, merged (:mod:`replay_client.sharded.merge`),
so a streamed batch is exactly a sampled one. Transform, pinning and the
device copy are the feed's, as on one server.

Grouping: with ``batches_per_message = k`` (chosen as for one server when
left to ``None``: :mod:`replay_client.grouping`), one round draws ``k``
batches at once (``k * batch_size`` merged draws, already shuffled, cut into
``k`` batches of iid draws), so the per-call cost of every shard is paid once
per ``k`` batches; as on one server, batches drawn together do not see
priority updates made between them, and the window holds two groups.

Not yet: batches travel as unary Sample answers over gRPC, never through a
same-host shared-memory ring, and one round is in flight at a time (the
learner overlaps it with its own step through ``prefetch``).

Waiting: while no shard has anything to sample, the source polls (``wait``)
up to ``wait_timeout`` per batch; a lost shard is retried with backoff
(``reconnect``), each retry counted in ``stream.stats.reconnects``. Both
waits end at once when the stream is closed.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


from replay_client import grouping
from replay_feed.backoff import Backoff
from replay_client.errors import (
    DeadlineExceededError,
    EmptyTableError,
    UnavailableError,
)
from replay_client.stream_options import feed_core
from replay_feed.core import FeedCore
from replay_feed.options import StreamOptions
from replay_feed.stream import BatchStream
from replay_proto.batch import SampleBatch

Draw = Callable[[int], SampleBatch]
"""``draw(n)``: one merged sample of ``n`` (``client.sample(table, n)``); raises the client's errors."""


class ShardedSource:
    """Produces a feed's batches by merged sampling over shards (see the module docstring).

    Args:
        draw: draws merged samples.
        batch_size: rows (or slices) per batch.
        group: batches drawn per round.
        shards: how many shards (for the stream's notes).
        num_batches: batches in all (0: until the learner stops).
        wait: wait while no shard has anything to sample (``False``: the
            stream ends with :class:`EmptyTableError`).
        wait_timeout: seconds one batch may wait for data (``None``: no limit).
        reconnect: retry a batch whose shard was unavailable, with backoff.
    """

    def __init__(self, draw: Draw, batch_size: int, group: int, shards: int, *,
                 num_batches: int, wait: bool, wait_timeout: float | None,
                 reconnect: bool) -> None:
        self._draw = draw
        self._batch_size = batch_size
        self._group = group
        self._shards = shards
        self._num_batches = num_batches
        self._wait = wait
        self._wait_timeout = wait_timeout
        self._reconnect = reconnect
        self._stopped = threading.Event()

    def run(self, core: FeedCore) -> None:
        core.stats.transport = "grpc"
        core.stats.notes.append(
            f"over {self._shards} shards: each batch one round of Sample calls, split by "
            f"mass and merged (exact); no shared-memory ring over shards")
        credits, index = core.prefetch, 0
        while not self._stopped.is_set() and (not self._num_batches
                                              or index < self._num_batches):
            count = self._group if not self._num_batches else min(
                self._group, self._num_batches - index)
            while credits < count:
                credits += core.wait_credits()
                if core.stopping.is_set():
                    return
            drawn = self._next(core, count * self._batch_size)
            if drawn is None:
                return
            for part in _cut(drawn, count, self._batch_size):
                core.deliver(index, part)
                index += 1
                credits -= 1

    def _next(self, core: FeedCore, rows: int) -> SampleBatch | None:
        """One batch, waiting for data or for a lost shard as configured (``None``: stopped)."""
        backoff = Backoff(math.inf, max_s=0.5)
        started = time.monotonic()
        while not self._stopped.is_set():
            try:
                return self._draw(rows)
            except EmptyTableError:
                if not self._wait:
                    raise
                waited = time.monotonic() - started
                if self._wait_timeout is not None and waited >= self._wait_timeout:
                    raise DeadlineExceededError(
                        f"no shard had anything to sample within wait_timeout="
                        f"{self._wait_timeout} s") from None
            except UnavailableError:
                if not self._reconnect:
                    raise
                core.stats.reconnects += 1
            self._stopped.wait(backoff.next_delay() or 0.5)
        return None

    def stop(self) -> None:
        self._stopped.set()


def _cut(batch: SampleBatch, count: int, size: int) -> list[SampleBatch]:
    """``batch`` (``count * size`` iid draws in random order) as ``count`` batches of ``size``."""
    if count == 1:
        return [batch]
    return [SampleBatch.from_columns(
        {k: v[i * size:(i + 1) * size] for k, v in batch.columns.items()},
        *(t[i * size:(i + 1) * size] for t in batch.extras),
        mass=batch.mass, missing_shards=batch.missing_shards) for i in range(count)]


def open_stream(draw: Draw, shards: int, table: str, batch_size: int, batch_bytes: int | None,
                options: StreamOptions) -> BatchStream:
    """A :class:`BatchStream` of merged batches (``batch_bytes``: one batch's size, for
    choosing the grouping; ``shared_memory`` does not apply).

    Raises:
        InvalidArgumentError: a bad delivery option (e.g. ``pin_memory=True`` without an accelerator).
    """
    prefetch, group, note = options.prefetch, options.batches_per_message, ""
    if group is None:
        chosen = grouping.choose(batch_bytes, prefetch)
        prefetch, group, note = chosen.prefetch, chosen.batches_per_message, chosen.note
    group = max(1, group)
    window = max(prefetch or grouping.DEFAULT_PREFETCH, 2 * group if group > 1 else 1)
    core = feed_core(window, options)
    source = ShardedSource(draw, batch_size, group, shards, num_batches=options.num_batches,
                           wait=options.wait, wait_timeout=options.wait_timeout,
                           reconnect=options.reconnect)
    stream = BatchStream(core, source, table)
    if note:
        stream.stats.notes.append(note)
    return stream
