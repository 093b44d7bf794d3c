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
from typing import Any

from replay_feed.core import FeedCore
from replay_feed.options import StreamOptions
from replay_feed.stream import BatchStream
from replay_proto.batch import SampleBatch
from replay_server.engine.table import Table
from replay_server.engine.table_set import TableSet
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    RateLimitedError,
)
from replay_server.service.server import ReplayServer
from replay_server.service.settings import ServerSettings

log = logging.getLogger("replay_server")


class TableSource:
    """Produces a feed's batches by sampling a table in this process (no sockets, no codec).

    A sample the table's rate limiter holds back, or (``wait``) one from an
    empty table, waits for the table to change
    (:attr:`Table.changes <replay_server.engine.table.Table.changes>`), then
    tries again, until it passes or the stream stops.

    Args:
        table: the table.
        batch_size: rows (or slices) per batch.
        num_batches: batches in all (0: until the learner stops).
        wait: wait while the table is empty (``False``: raise EmptyTableError).
    """

    def __init__(self, table: Table, batch_size: int, num_batches: int = 0,
                 wait: bool = True) -> None:
        self.table = table
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.wait = wait
        self._stopped = threading.Event()

    def run(self, core: FeedCore) -> None:
        core.stats.transport = "in_process"
        credits = core.prefetch
        index = 0
        while not self._stopped.is_set() and (not self.num_batches or index < self.num_batches):
            while credits == 0:
                credits += core.wait_credits()
                if core.stopping.is_set():
                    return
            # A device table gathers on its device into new tensors: no host staging.
            layout = {} if self.table.config.on_device else self.table.batch_layout(
                self.batch_size)
            buffers = core.staging(index, tuple(layout.values())) if layout else []
            batch = self._sample(dict(zip(layout, buffers)) if layout else None)
            if batch is None:
                return
            core.deliver(index, batch)
            index += 1
            credits -= 1

    def _sample(self, out: dict | None) -> SampleBatch | None:
        """One batch; while the rate limiter holds it back, wait for a change (None: stopped)."""
        changes = self.table.changes
        while True:
            mark = changes.mark()  # before the stop check: a stop after it wakes the wait below
            if self._stopped.is_set():
                return None
            try:
                return self.table.sample(self.batch_size, out=out)
            except RateLimitedError:
                changes.wait(mark)
            except EmptyTableError:
                if not self.wait:
                    raise
                changes.wait(mark)

    def stop(self) -> None:
        self._stopped.set()
        self.table.changes.wake()


def stream_table(table: Table, batch_size: int, options: StreamOptions | None = None,
                 **keywords: Any) -> BatchStream:
    """A learner's stream over an in-process table (options as ``ReplayClient.stream``: one
    :class:`~replay_feed.options.StreamOptions`). ``prefetch`` defaults to 2; a connection's
    options (``reconnect``, ``shared_memory``, ``batches_per_message``) have nothing to act
    on in process.

    Raises:
        InvalidArgumentError: a bad option (e.g. ``pin_memory=True`` without an accelerator).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    try:
        opts = StreamOptions.build(options, **keywords)
        core = FeedCore(opts.prefetch or 2, opts.delivery(), opts.transform)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    source = TableSource(table, batch_size, opts.num_batches, opts.wait)
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
        if listen:
            self._start()
            assert self._server is not None
            self.tables = self._server.tables
        else:
            self.tables = TableSet(self.settings.table_configs)

    def _start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
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
