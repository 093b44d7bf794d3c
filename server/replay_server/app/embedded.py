"""Embedded mode: the replay server inside the learner's process.

A learner that owns its replay memory skips the network on the sampling side
entirely: :meth:`EmbeddedServer.stream` draws batches straight from the
tables on a background thread, gathering rows from table storage into the
feed's staging ring (pinned when an accelerator is present, as is the table
storage under ``pin_memory = "auto"``) and copying them to the device on a
side stream, exactly like ``ReplayClient.stream`` (see
:mod:`replay_feed.core`). A device table (``device = "cuda"``) gathers on
its device instead: its batches reach the learner with no host copy (no
staging, pinning or device copy; ``stream.stats.resident`` counts them),
on the table's device unless ``device=`` names another. Actors in other
processes still insert over gRPC: the embedded server listens like a
standalone one unless ``listen=False``.

::

    with EmbeddedServer() as server:             # default tables, 127.0.0.1:50051
        ...                                      # actors: ReplayClient(server.address)
        for batch in server.stream("replay", 256, device="cuda"):
            ...
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replay_feed.core import FeedCore
from replay_feed.credits import CreditFlow, PriorityUpdate
from replay_feed.link import apply_until_stopping, drawn_here
from replay_feed.source import LinkSource
from replay_feed.options import DEFAULT_PREFETCH, StreamOptions
from replay_feed.stream import BatchStream
from replay_proto.batch import SampleBatch
from replay_proto.scalars import is_int
from replay_server.engine import Table, TableSet, update_values
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    RateLimitedError,
)
from replay_server.service.loop import new_loop
from replay_server.service.server import ReplayServer
from replay_server.service.settings import ServerSettings

log = logging.getLogger("replay_server")


class TableLink:
    """A table in this process as a :class:`~replay_feed.link.Link`: no sockets, no codec.

    One endless call: it draws a batch whenever the learner's credits allow
    (its grants applied as they come: priority updates before the next draw),
    gathering rows straight into the feed's staging buffers (a device
    table's batch stays on its device). A sample the table's rate limiter
    holds back, or (``wait``) one from an empty table, waits for the table to
    change (:attr:`Table.changes <replay_server.engine.table.Table.changes>`),
    at most ``wait_timeout`` seconds, then tries again, until it passes or the
    stream stops.

    Args:
        table: the table.
        batch_size: rows (or slices) per batch.
        staging: the feed's staging buffers of batch ``k`` (``staging(k, layout)``).
        wait: wait while the table is empty (``False``: raise EmptyTableError).
        wait_timeout: seconds one batch may wait (``None``: no limit); then the
            stream ends with :class:`RateLimitedError` (DEADLINE_EXCEEDED over gRPC).
    """

    transport = "in_process"

    def __init__(self, table: Table, batch_size: int,
                 staging: Callable[[int, Any], list[torch.Tensor]], *, wait: bool = True,
                 wait_timeout: float | None = None) -> None:
        self.table = table
        self.batch_size = batch_size
        self._staging = staging
        self.wait = wait
        self.wait_timeout = wait_timeout
        self._stopped = threading.Event()

    def call(self, flow: CreditFlow, credits: int, updates: list[PriorityUpdate],
             remaining: int, first: int) -> Iterator[SampleBatch]:
        return drawn_here(flow, credits, updates, remaining, first, apply=self._apply,
                          draw=self._draw, stopped=self._stopped.is_set)

    def _draw(self, index: int) -> SampleBatch | None:
        # A device table gathers on its device into new tensors: no host staging.
        layout = {} if self.table.config.on_device else self.table.batch_layout(self.batch_size)
        buffers = self._staging(index, tuple(layout.values())) if layout else []
        return self._sample(dict(zip(layout, buffers)) if layout else None)

    def _apply(self, updates: list[PriorityUpdate]) -> None:
        for update in updates:
            self.table.update_priorities(update.ids, update.priorities)

    def _sample(self, out: dict | None) -> SampleBatch | None:
        """One batch; while the rate limiter holds it back, wait for a change (None: stopped)."""
        changes = self.table.changes
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        while True:
            mark = changes.mark()  # before the stop check: a stop after it wakes the wait below
            if self._stopped.is_set():
                return None
            try:
                return self.table.sample(self.batch_size, out=out)
            except RateLimitedError:
                if not self._wait_for_change(mark, deadline):
                    raise
            except EmptyTableError as exc:
                if not self.wait:
                    raise
                if not self._wait_for_change(mark, deadline):
                    raise RateLimitedError(
                        f"{exc}; waited for data {self.wait_timeout} s", table=self.table.name,
                        operation="sample", count=self.batch_size) from None

    def _wait_for_change(self, mark: tuple[int, int], deadline: float | None) -> bool:
        """Wait for the table to change; False once ``deadline`` has passed."""
        if deadline is None:
            self.table.changes.wait(mark)
            return True
        left = deadline - time.monotonic()
        return left > 0 and (self.table.changes.wait(mark, left) or time.monotonic() < deadline)

    def after_last(self, flow: CreditFlow) -> None:
        apply_until_stopping(flow, self._apply)

    def stop(self) -> None:
        self._stopped.set()
        self.table.changes.wake()

    def close(self) -> None:
        pass


def stream_table(table: Table, batch_size: int, options: StreamOptions | None = None,
                 **keywords: Any) -> BatchStream:
    """A learner's stream over an in-process table (options as ``ReplayClient.stream``: one
    :class:`~replay_feed.options.StreamOptions`). ``prefetch`` defaults to
    ``DEFAULT_PREFETCH``; a connection's options (``reconnect``, ``shared_memory``,
    ``batches_per_message``) have nothing to act on in process.

    Raises:
        InvalidArgumentError: a bad option (e.g. ``pin_memory=True`` without an accelerator).
    """
    if not is_int(batch_size) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    try:
        opts = StreamOptions.build(options, **keywords)
        core = FeedCore(opts.prefetch or DEFAULT_PREFETCH, opts.delivery(), opts.transform)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    link = TableLink(table, batch_size, core.staging, wait=opts.wait,
                     wait_timeout=opts.wait_timeout)
    def check_update(ids: Any, priorities: Any) -> PriorityUpdate:
        return PriorityUpdate(*update_values(ids, priorities, table.name))

    source = LinkSource(link, check_update=check_update, num_batches=opts.num_batches,
                        reconnect=False, name=table.name)
    return BatchStream(core, source, table.name)


class EmbeddedServer:
    """A replay server running in this process, on a background event-loop thread.

    Args:
        settings: server settings (default: the default tables on 127.0.0.1:50051;
            use address "127.0.0.1:0" for any free port).
        listen: serve gRPC for other processes (actors); False: tables only.

    Raises:
        ConfigError: invalid settings, or the address cannot be bound.

    Thread-safety: tables and streams may be used from any thread.
    """

    def __init__(self, settings: ServerSettings | None = None, *, listen: bool = True) -> None:
        self.settings = settings or ServerSettings()
        self._server: ReplayServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.tables: TableSet
        if listen:
            self._start()
            assert self._server is not None
            self.tables = self._server.tables
        else:
            self.tables = TableSet(self.settings.table_configs)

    def _start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []
        self._loop = new_loop()
        self._server = ReplayServer(self.settings)

        def run() -> None:
            assert self._loop is not None and self._server is not None
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._server.start())
            except BaseException as exc:  # reported to the constructor
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="replay-embedded-server", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            if isinstance(failure[0], ConfigError):
                raise failure[0]
            raise ConfigError(f"the embedded server did not start: {failure[0]}") from failure[0]

    @property
    def address(self) -> str | None:
        """``host:port`` actors connect to (None when not listening)."""
        if self._server is None or self._server.port is None:
            return None
        host = self.settings.address.rsplit(":", 1)[0]
        return f"{host}:{self._server.port}"

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of ``/metrics`` (None when metrics are off or the server stopped):
        the port bound, also where ``metrics_address`` asked for port 0."""
        server = self._server
        if server is None or server.metrics is None or server.metrics.port is None:
            return None
        assert self.settings.metrics_address is not None
        host = self.settings.metrics_address.rsplit(":", 1)[0]
        return f"{host}:{server.metrics.port}"

    def stream(self, table: str, batch_size: int, options: StreamOptions | None = None,
               **keywords: Any) -> BatchStream:
        """Batches sampled in this process; options as ``ReplayClient.stream`` (see :func:`stream_table`).

        Raises:
            UnknownTableError: no such table.
        """
        return stream_table(self.tables[table], batch_size, options, **keywords)

    def close(self, grace: float = 5.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds); tables stay readable. Idempotent."""
        server, loop, self._server = self._server, self._loop, None
        if server is None or loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(server.stop(grace), loop)
        deadline = time.monotonic() + grace + 5
        future.result(timeout=max(0.1, deadline - time.monotonic()))
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        loop.close()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
