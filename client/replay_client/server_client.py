"""``ServerClient``: the actor's and learner's handle on one replay server."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

from replay_client import chunked, grouping, table_rows, variables
from replay_client.arguments import check_int as _check_int
from replay_client.arguments import id_array, insert_columns, priority_update, update_arrays
from replay_client.connection import CLIENT_TIMEOUT, CONNECT_TIMEOUT_S, Connection
from replay_client.errors import (
    InvalidArgumentError,
    StreamEndedError,
    UnknownTableError,
)
from replay_client.leases import ClientLeases
from replay_client.stream import SampleLink, StagingTarget
from replay_client.stream_options import feed_core, reconnect_window, stream_options
from replay_client.table_info import ServerInfo, TableInfo, server_info_of
from replay_client.tls import TlsConfig
from replay_client.update_parts import max_ids_per_message, update_parts
from replay_client.call_fallback import StreamFallback, unary_after
from replay_client.call_stream import CallStream
from replay_client.updates import PriorityUpdater
from replay_client.variables import Variable
from replay_client.writer import Writer
from replay_client.vector_writer import vector_writer
from replay_feed.eager import runs_eagerly
from replay_feed.options import StreamOptions
from replay_feed.source import LinkSource
from replay_feed.stream import BatchStream
from replay_proto import messages
from replay_proto.batch import SampleBatch
from replay_proto.v1 import replay_pb2 as pb

class ServerClient:
    """A connection to one replay server: the one-server :class:`~replay_client.api.ReplayApi`.

    Built by :class:`~replay_client.client.ReplayClient` from a ``host:port``
    (a list of addresses or a ``shards://`` name builds the sharded client,
    a layer over these; ``docs/scale-out.md``).

    Cheap to create and safe to share between threads. It connects lazily, on
    the first call, and pickles as its settings alone, so it can be handed to
    actor processes (each reconnects on its own).

    Retries: calls that are safe to repeat (sample, update_priorities, info,
    reset) are retried with exponential backoff while the server is
    UNAVAILABLE, within the call's timeout; insert is only while gRPC could not
    connect at all (nothing was sent), never once it may have reached the server
    (a retry could store rows twice), so an insert that fails with
    :class:`UnavailableError` may or may not have been stored.

    Rate limiting: an insert or sample that a table's rate limiter holds back
    waits on the server (which holds no thread for it) up to the call's
    timeout, then raises :class:`~replay_client.errors.DeadlineExceededError` naming the limiter's
    state; it is never retried. ``timeout=None`` waits as long as it takes.

    Args:
        address: ``host:port`` of the server (``host`` alone: port 50051).
        timeout: seconds each call may take, retries included (``None``: no limit).
        token: auth token, sent as ``authorization: Bearer <token>``; defaults
            to the ``REPLAY_TOKEN`` environment variable when set.
        max_message_mb: the message-size limit (match the server's).
        max_retry_s: longest total time spent retrying an unavailable server.
        tls: ``None``: plaintext; ``True``: TLS trusting the system's CAs; a
            :class:`~replay_client.tls.TlsConfig`: TLS with its CA and, for
            mutual TLS, the client's certificate and key.
        allow_plaintext_token: send the token over plaintext to a non-loopback
            address (it can be read on the network); otherwise that is refused.
        connect_timeout_s: seconds calls retry a server that has not answered yet
            (nothing listening at ``address``) before raising
            :class:`UnavailableError` "no replay server at HOST:PORT (is it running?)".

    Raises:
        InvalidArgumentError: the address is not a string, or a token would
            travel in clear text to another host.
    """

    def __init__(
        self,
        address: str = "localhost:50051",
        *,
        timeout: float | None = 30.0,
        token: str | None = None,
        max_message_mb: int = 4,
        max_retry_s: float = 10.0,
        tls: TlsConfig | bool | None = None,
        allow_plaintext_token: bool = False,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        if not isinstance(address, str):
            raise InvalidArgumentError(
                f"address must be 'host:port', a list of shard addresses or "
                f"'shards://name:port', got {type(address).__name__}"
            )
        if not (tls is None or isinstance(tls, (bool, TlsConfig))):
            raise InvalidArgumentError(
                f"tls must be None, True or a TlsConfig, got {type(tls).__name__}")
        self._connection = Connection(
            address, timeout=timeout, token=token if token is not None else os.environ.get(
                "REPLAY_TOKEN"), max_message_mb=max_message_mb, max_retry_s=max_retry_s,
            tls=TlsConfig() if tls is True else (tls or None),
            allow_plaintext_token=allow_plaintext_token, connect_timeout_s=connect_timeout_s)
        self._answers = chunked.LargeAnswers(self._connection, lambda: self._stream("sample"))
        self._leases = ClientLeases()
        self._lock = threading.Lock()
        self._updater: PriorityUpdater | None = None
        self._updater_pid = 0
        self._call_streams: dict[str, CallStream] = {}  # by kind: updates, inserts, samples
        self._call_streams_pid = 0
        self._slice_lens: dict[str, int] = {}

    @property
    def address(self) -> str:
        return self._connection.address

    @property
    def timeout(self) -> float | None:
        return self._connection.timeout

    @property
    def connection(self) -> Connection:
        """The connection's settings and channel (shared by this client's calls and streams)."""
        return self._connection

    # ------------------------------------------------------------ connection

    def __getstate__(self) -> dict[str, Any]:
        return self._connection.__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("address"), **state)  # type: ignore[misc]

    def close(self) -> None:
        """Send pending ``wait=False`` updates, then close the connection (a later call reconnects)."""
        updater, self._updater = self._updater, None
        try:
            if updater is not None:
                try:
                    updater.flush()
                finally:
                    updater.close()
        finally:
            streams, self._call_streams = self._call_streams, {}
            if self._call_streams_pid == os.getpid():
                for stream in streams.values():
                    stream.close()
            self._connection.close()

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------- API

    @runs_eagerly
    def insert(self, table: str, data: Any, priorities: Any = None) -> torch.Tensor:
        """Append rows to ``table``; returns their int64 ids.

        Args:
            table: table name.
            data: mapping (nested allowed) of tensors or numpy arrays, rows along
                the leading dim; or a TensorDict, whose batch dims say what a row
                is (``[n_envs, T]``: ``n_envs * T`` rows, see :mod:`replay_proto.rows`).
            priorities: ``[rows]`` priorities (prioritized tables only).

        Raises:
            SchemaMismatchError, InvalidArgumentError, InvalidPriorityError,
            NoPrioritiesError, UnknownTableError, UnavailableError, ...
        """
        columns, prios = insert_columns(data, priorities)
        return chunked.insert(self._connection, table, columns, prios, self._stream("insert"))

    @runs_eagerly
    def sample(self, table: str, batch_size: int, *, wait: bool | None = None,
               timeout: Any = CLIENT_TIMEOUT) -> SampleBatch:
        """Draw one batch; ``batch.data`` keeps the inserted (nested) structure.

        Args:
            table: table name.
            batch_size: rows (or slices).
            wait: ``True``: while the table cannot serve the batch (empty, or
                held back by its rate limiter), wait on the server (holding no
                thread there). ``False``: never wait: raise
                :class:`EmptyTableError` at once. ``None`` (the default): an
                empty table raises :class:`EmptyTableError` at once, a sample
                the rate limiter holds back waits (Reverb's flow control).
            timeout: seconds the call may take, waiting included (default: the
                client's; ``None``: no limit), then :class:`DeadlineExceededError`.

        On a queue table (``fifo``/``lifo``) the rows are taken under a lease:
        the client's next sample of the table (or :meth:`ack`) acknowledges
        them; a retry after a lost answer gets the same rows; rows never
        acknowledged return to the queue after the table's ``lease_timeout_s``
        (:mod:`replay_client.leases`; docs/service.md, "Delivery").

        Raises:
            InvalidArgumentError: ``batch_size`` is not a positive integer (checked here).
            EmptyTableError, UnknownTableError, DeadlineExceededError, ...: from the server.
        """
        _check_int("batch_size", batch_size, 1)
        lease, acknowledge = self._leases.next(table)
        request = pb.SampleRequest(table=table, batch_size=batch_size, wait_for_data=bool(wait),
                                   never_wait=wait is False, lease=lease,
                                   acknowledge=acknowledge).SerializeToString()
        batch = self._answers.sample(table, batch_size, request, timeout)
        self._leases.taken(table, lease, acknowledge)
        return batch

    def ack(self, table: str) -> None:
        """Acknowledge the rows this client's samples of queue table ``table`` took: they
        never return to the queue (its next sample would acknowledge them too). A no-op
        for other tables, and when nothing is pending."""
        pending = self._leases.pending(table)
        if pending:
            request = pb.AcknowledgeRequest(table=table, leases=pending).SerializeToString()
            self._connection.unary("Acknowledge", request, retry=True)
            self._leases.acknowledged(table, pending)

    @runs_eagerly
    def update_priorities(
        self, table: str, ids: Any, priorities: Any, *, wait: bool = True
    ) -> int | None:
        """Set priorities by id.

        Args:
            table: table name.
            ids: int64 ids (from insert or sample), any shape.
            priorities: finite values >= 0, same shape.
            wait: ``True``: send now and return how many ids still named
                stored rows (on the client's persistent call stream: one
                round trip, see :mod:`replay_client.call_stream`; from the
                server's host over a Unix socket, :mod:`replay_client.local_updates`). An update
                over the message limit goes as several requests in order
                (:mod:`replay_client.update_parts`); if one is refused, the
                ones before it stay applied (the error's note says how many).
                ``False``: queue it for a background thread and
                return ``None`` at once; updates stay in order, are merged
                while one is in flight (see :mod:`replay_client.updates`), and
                a failure is raised by the next update or :meth:`flush_updates`.

        Raises:
            InvalidIdsError, InvalidPriorityError: checked here, before sending.
            NoPrioritiesError, UnknownTableError, ...: from the server.
            PriorityUpdateError: an earlier ``wait=False`` update failed.
        """
        id_array, values = update_arrays(ids, priorities)
        if not wait:
            self._updates().submit(table, id_array, values)
            return None
        if self._updater is not None:
            self._updater.flush()  # keep order with earlier wait=False updates
        applied = 0
        parts = list(self._update_parts(table, id_array, values))
        for number, (part_ids, part_values) in enumerate(parts):
            try:
                applied += self._send_update(table, part_ids, part_values)
            except Exception as exc:
                if number:
                    exc.add_note(f"{number} of {len(parts)} requests of this update were "
                                 f"applied before ({applied} ids present)")
                raise
        return applied

    def flush_updates(self, timeout: float | None = None) -> None:
        """Wait until every ``update_priorities(..., wait=False)`` was applied (or raise its error)."""
        if self._updater is not None:
            self._updater.flush(timeout)

    def _send_update(self, table: str, ids: np.ndarray, priorities: np.ndarray) -> int:
        """One update, on the client's call stream when the server has one, else unary."""
        raw = messages.encode_update(table, ids, priorities)

        def unary() -> int:
            answer = self._connection.unary("UpdatePriorities", raw, retry=True)
            return int(pb.UpdatePrioritiesResponse.FromString(answer).applied)

        try:
            return int(self._stream("update_priorities").send(raw).update_priorities.applied)
        except StreamFallback as fallback:
            return unary_after(fallback, unary)

    def _update_parts(self, table: str, ids: np.ndarray, priorities: np.ndarray
                      ) -> Any:
        """``(ids, priorities)`` as requests under the message limit; flat ids are cut at
        multiples of the table's ``slice_len`` (asked once, only when flat ids must be cut)."""
        max_ids = max_ids_per_message(self._connection.max_message_bytes)
        step = 1
        if ids.size > max_ids and ids.ndim == 1:
            if table not in self._slice_lens:
                found = self.info().get(table)
                self._slice_lens[table] = (found.slice_len or 1) if found else 1
            step = self._slice_lens[table]
        return update_parts(ids, priorities, max_ids, step)

    def _stream(self, kind: str) -> CallStream:
        """This process's call stream for ``kind`` (a forked child opens its own)."""
        with self._lock:
            if self._call_streams_pid != os.getpid():
                self._call_streams, self._call_streams_pid = {}, os.getpid()
            stream = self._call_streams.get(kind)
            if stream is None:
                stream = self._call_streams[kind] = CallStream(self._connection, kind)
            return stream

    def _updates(self) -> PriorityUpdater:
        with self._lock:
            if self._updater is None or self._updater_pid != os.getpid():
                self._updater = PriorityUpdater(
                    self._send_update, parts=self._update_parts,
                    max_ids_per_call=max_ids_per_message(self._connection.max_message_bytes))
                self._updater_pid = os.getpid()
            return self._updater

    @runs_eagerly
    def info(self) -> dict[str, TableInfo]:
        """Every table's sizes, counters and settings, by name."""
        return self.server_info().tables

    @runs_eagerly
    def server_info(self) -> ServerInfo:
        """The server's shard, id incarnation and limits (with what is in use), and its tables."""
        response = pb.InfoResponse.FromString(
            self._connection.unary("Info", pb.InfoRequest().SerializeToString(), retry=True)
        )
        return server_info_of(response)

    def checkpoint(self, *, timeout: float | None = 600.0) -> str:
        """Have the server write a checkpoint of every table; returns its path (on the server).

        The checkpoint starts after this call arrives, so it holds every row
        acknowledged before it. Not retried (a retry could start a second
        checkpoint). ``timeout``: seconds to wait (writing takes about a
        second per GB here); ``None``: no limit.

        Raises:
            NoCheckpointDirError: the server has no ``checkpoint_dir``.
            CheckpointError: the write failed (e.g. disk full); the server keeps serving.
            UnavailableError, DeadlineExceededError, ...
        """
        request = pb.CheckpointRequest().SerializeToString()
        raw = self._connection.unary("Checkpoint", request, retry=False, timeout=timeout)
        return pb.CheckpointResponse.FromString(raw).path

    def reset(self, table: str, *, schema: bool = False) -> None:
        """Remove every row of ``table``; old ids become stale.

        ``schema=True`` also forgets the schema its first insert fixed, so the
        next insert may bring other keys, dtypes or shapes (a schema the
        server's config declares stays).
        """
        self._connection.unary(
            "Reset", pb.ResetRequest(table=table, schema=schema).SerializeToString(), retry=True)

    @runs_eagerly
    def delete(self, table: str, ids: Any) -> int:
        """Remove rows by id from a queue table (sampler ``fifo`` or ``lifo``).

        Ids of rows already taken, deleted or overwritten are ignored. The
        call is retried while the server is unavailable, so after a retry the
        count may leave out rows the first attempt removed.

        Returns:
            How many of ``ids`` named rows present (and were removed).

        Raises:
            InvalidIdsError: ``ids`` are not int64 (checked here), or were never
                issued by the table (from the server).
            InvalidArgumentError: the table is not a queue table.
        """
        request = pb.DeleteRequest(table=table, ids=id_array(ids).tolist())
        raw = self._connection.unary("Delete", request.SerializeToString(), retry=True)
        return pb.DeleteResponse.FromString(raw).deleted


    @runs_eagerly
    def read(self, table: str, **request: Any) -> table_rows.RowsRead:
        """Stored rows by ``positions=`` or ``ids=`` (:func:`replay_client.table_rows.read`)."""
        return table_rows.read(self._connection, table, **request)

    @runs_eagerly
    def write(self, table: str, positions: Any, data: Any) -> int:
        """Overwrite stored rows by position (:func:`replay_client.table_rows.write`)."""
        return table_rows.write(self._connection, table, positions, data)

    def set_sampling(self, table: str, **settings: Any) -> tuple[float, float]:
        """``alpha=``, ``beta=``, ``seed=`` from now on (:func:`replay_client.table_rows.set_sampling`)."""
        return table_rows.set_sampling(self._connection, table, **settings)
    @runs_eagerly
    def publish(self, name: str, state_dict: Any) -> int:
        """Store ``state_dict`` (tensors only) as the next version of variable ``name``.

        The server keeps the newest version of each name, within its budget
        (``server.variables_max_mb``), in its checkpoints too; fetches waiting
        for a newer version are answered at once. Not retried (a retry could
        publish twice). See :mod:`replay_client.variables`.

        Returns:
            The version it got: 1 for a new name, then 2, 3, ...

        Raises:
            InvalidVariableError: not a mapping of non-empty string keys to dense
                tensors of a supported dtype, empty, or a bad name (nothing sent
                when the client can tell).
            VariableBudgetError: the server's variables would exceed its budget.
            OverloadedError, LimitExceededError: a variable over the message limit
                travels in chunks, reserved whole from the server's memory budget.
        """
        return variables.publish(self._connection, name, state_dict)

    @runs_eagerly
    def fetch(self, name: str, newer_than: int | None = None,
              timeout: float | None = None) -> Variable | None:
        """The newest version of variable ``name``, as a :class:`~replay_client.variables.Variable`.

        A ``Variable`` is a dict of fresh tensors (``model.load_state_dict(v)``)
        with ``.version`` attached. With ``newer_than``, only a version newer
        than that one is returned: the call waits on the server (holding no
        thread there) until one is published, for at most ``timeout`` seconds
        (``None``: as long as it takes), and returns ``None`` if none came.
        ``newer_than=0`` waits for the first publish of a name.

        Raises:
            UnknownVariableError: nothing was published under ``name`` (without ``newer_than``).
            InvalidArgumentError: a bad ``newer_than`` or ``timeout``.
        """
        return variables.fetch(self._answers, name, newer_than, timeout)

    def writer(self, table: str, **options: Any) -> Writer:
        """A :class:`~replay_client.writer.Writer` appending steps to ``table``.

        Unless ``episode_key=`` is given, the writer follows the table (one ``info``
        call): episode ids go in the table's episode column where it keeps episodes
        (slice tables, n-step readers) or declares that column, and nowhere else.

        Raises:
            UnknownTableError: no such table (asked only when ``episode_key`` is not given).
        """
        if "episode_key" not in options:
            tables = self.info()
            if table not in tables:
                raise UnknownTableError(f"no table named {table!r} on {self.address}; tables "
                                        f"there: {', '.join(sorted(tables)) or 'none'}")
            options["episode_key"] = tables[table].writer_episode_key
        return Writer(self, table, **options)

    vector_writer = vector_writer  # a vector env's steps, one episode per sub-env

    def stream(self, table: str, batch_size: int, options: StreamOptions | None = None,
               **keywords: Any) -> BatchStream:
        """A learner's stream of batches, produced in the background (see ``docs/learner.md``).

        ``for batch in client.stream("replay", 256, device="cuda"): ...`` -
        batches arrive in order, complete, with ids and weights, already on
        the device. A background thread receives them into a reused ring of
        staging buffers (pinned when an accelerator is present), applies
        ``transform``, pins what it returns, and starts the device copy on a
        side stream; ``next()`` only makes the current stream wait for that
        copy. At most ``prefetch`` batches are in flight or buffered besides
        the one the learner holds: the server draws a batch only once the
        learner has room for it.

        On the server's host, batches come through a shared-memory ring
        instead of gRPC (``stream.transport`` says which; it falls back to
        gRPC by itself). Host batches (``device=None``) are views of the ring:
        valid until the next batch is requested. Breaking out of the loop
        stops everything and frees the buffers. A lost connection is resumed
        (``reconnect``; see :mod:`replay_client.stream`).

        On a queue table (``fifo``/``lifo``) the batches are leased: a batch
        is finished when the next one is requested (or by ``stream.ack()``),
        and those not finished when the stream ends (closed, broken, the
        learner killed) return to the queue (``docs/service.md``, "Delivery").

        Args:
            table: table name.
            batch_size: rows (or slices) per batch.
            options: a :class:`~replay_feed.options.StreamOptions`; ``keywords``
                (its field names: ``prefetch``, ``device``, ``pin_memory``,
                ``transform``, ``num_batches``, ``batches_per_message``,
                ``shared_memory``, ``reconnect``, ``wait``, ``wait_timeout``,
                ``memory_mb``) set fields on it, or on the defaults.

        Raises:
            InvalidArgumentError: a bad option (``pin_memory=True`` or a CUDA
                device without CUDA, ``prefetch < 1``, ...), before any network call.
        """
        _check_int("batch_size", batch_size, 1)
        opts = stream_options(options, keywords)
        grouped = grouping.given(opts.batches_per_message, opts.prefetch)
        core = feed_core(grouped.prefetch, opts)
        link = self.link(table, batch_size,
                         StagingTarget(core.staging, core.copy_rows, core.stats, core.delivery,
                                       core.when_given_back),
                         batches_per_message=opts.batches_per_message, prefetch=opts.prefetch,
                         shared_memory=opts.shared_memory and grouped.batches_per_message == 1,
                         wait=opts.wait, wait_timeout=opts.wait_timeout)
        if opts.prefetch is None:  # the stream's own window: widened over a slow link
            core.grow_window(opts.memory_mb * 2**20, lambda: link.window_grows)
        source = LinkSource(link, check_update=priority_update, num_batches=opts.num_batches,
                            reconnect=opts.reconnect,
                            retry_window_s=reconnect_window(opts, self._connection),
                            name=self._connection.address)
        stream = BatchStream(core, source, table, ended_error=StreamEndedError)
        if grouped.note:
            stream.stats.notes.append(grouped.note)
        return stream

    def link(self, table: str, batch_size: int, target: StagingTarget, *,
             batches_per_message: int | None = 1, prefetch: int | None = None,
             shared_memory: bool = True, wait: bool = True,
             wait_timeout: float | None = None,
             most_per_message: int = grouping.MAX_GROUP) -> SampleLink:
        """This server's ``SampleStream`` as a :class:`~replay_feed.link.Link` (arguments as
        :class:`~replay_client.stream.SampleLink`'s), for :meth:`stream` and for a stream
        built over many servers (the sharded stream's shards)."""
        return SampleLink(self._connection, table, batch_size, target,
                          batches_per_message=batches_per_message, prefetch=prefetch,
                          shared_memory=shared_memory, wait=wait, wait_timeout=wait_timeout,
                          most_per_message=most_per_message)



