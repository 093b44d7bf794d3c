"""A table: a fixed-capacity FIFO ring of rows, stored column-wise, with one sampler.

Rows go in through :meth:`Table.insert` (leading dim = rows) and get int64 ids
that are never issued twice, not even across crashes (see
:mod:`replay_server.engine.id_space`; inside, rows are counted by position:
:mod:`replay_server.engine.ids`); samples come out as
:class:`~replay_proto.batch.SampleBatch`; priorities are updated by id. The
table is the only orchestrator: under its lock it writes storage and tells
its sampler exactly once. It is also the only door: other modules and layers
call its methods, never act on its parts. What it is handed is checked and
converted once, before the lock (:mod:`~replay_server.engine.insert_rows`,
:mod:`~replay_server.engine.priority_update`, :mod:`~replay_server.engine.inputs`);
a sample's rows are drawn and read by :mod:`~replay_server.engine.draw`;
its state is saved and loaded by :mod:`~replay_server.engine.table_state`, its
memory promised by :mod:`~replay_server.engine.table_memory`; everything it
mutates is one :class:`~replay_server.engine.table_parts.TableParts`.

Every method either succeeds or raises a
:class:`~replay_server.errors.ReplayServerError` having changed nothing.

Flow control: the table's :class:`~replay_server.engine.rate_limiter.RateLimiter`
is consulted under the lock by ``insert`` and ``sample``; a call it holds back
raises :class:`~replay_server.errors.RateLimitedError` at once (the service
turns that into waiting; an in-process caller can wait on :attr:`Table.changes`).
Rows that leave when sampled (``max_times_sampled``, ``fifo``/``lifo``) are
the table's remover's (:mod:`replay_server.engine.remover`).

Thread-safety: all public methods may be called from any thread; one lock per
table serializes them (tables do not block each other). Tensor conversion of
inputs happens before the lock is taken, the copies in and out under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from replay_proto.batch import SampleBatch, batch_nbytes
from replay_server.engine import draw_settings, row_access
from replay_server.engine.change_clock import ChangeClock
from replay_server.engine.draw import batch_of, draw
from replay_server.engine.config import TableConfig
from replay_server.engine.incarnations import IncarnationSource
from replay_server.engine.inputs import (
    MAX_BATCH_SIZE,
    batch_size_of,
    check_sampler_columns,
    columns_of,
    id_values,
)
from replay_server.engine.insert_rows import InsertRows
from replay_server.engine.memory import MemoryLedger
from replay_server.engine.storage.placement import table_device
from replay_server.engine.rate_limiter import RateLimiter
from replay_server.engine.row_access import RowRead
from replay_server.engine.insert_event import InsertEvent
from replay_server.engine.leases import LeaseRequest
from replay_server.engine.priority_update import PriorityUpdate
from replay_server.engine.schema import Schema, schema_of
from replay_server.engine.storage import ColumnStorage
from replay_server.engine.snapshot import DEFAULT_CHUNK_BYTES, TableSnapshot
from replay_server.engine.table_memory import TableMemory
from replay_server.engine.table_info import TableCounters, TableFigures, TableInfo
from replay_server.engine.table_parts import TableParts, fresh_parts, schema_way_out
from replay_server.engine.table_state import STATE_VERSION, load_parts, snapshot_parts
from replay_server.errors import (
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidPriorityError,
    NoPrioritiesError,
    SchemaMismatchError,
    TableSpaceError,
)

__all__ = ["MAX_BATCH_SIZE", "STATE_VERSION", "Table", "TableCounters"]


class Table:
    """A named replay table. See the module docstring for the concepts.

    Args:
        config: the table's validated configuration.
        incarnations: where its id segments get their incarnation and shard
            (a server's; ``None``: in-process, shard 0 and incarnation 0).
        memory: the ledger its memory is promised from (a server's tables
            share one; ``None``: this machine's memory, for this table alone).

    Raises:
        ConfigError: the declared schema cannot serve the sampler (e.g. a slice
            table without an integer episode column), pinned memory was
            requested without an accelerator, or the table's sampler state (and
            declared schema) at its capacity need more memory than ``memory`` allows.
    """

    def __init__(self, config: TableConfig, incarnations: IncarnationSource | None = None,
                 memory: MemoryLedger | None = None) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._incarnations = incarnations
        self._memory = TableMemory(config, memory or MemoryLedger())
        try:
            self._memory.promise_state(None if config.schema is None else Schema(config.schema))
            self._parts = fresh_parts(config, incarnations, self._memory.growth)
        except InsufficientMemoryError as exc:
            raise TableSpaceError(str(exc)) from None
        self._instant_bytes = 0  # what the last snapshot's instant copied: the next one's arena
        self._device = table_device(config)  # a device table's: rows already there stay there
        self._episodes = (config.sampler.traits.episodes or config.n_step > 1
                          or config.frame_stack_key is not None)
        """Whether inserts tell the episode ids and ends (to the sampler or the readers)."""
        self.changes = ChangeClock()
        """Ticks once per insert, sample, priority update, reset and load."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def schema(self) -> Schema | None:
        """The columns, fixed by the config or the first insert (``None`` before)."""
        return self._parts.schema

    @property
    def size(self) -> int:
        """Rows present (retired rows excluded)."""
        return self._parts.size

    @property
    def rate_limiter(self) -> RateLimiter:
        """The table's rate limiter (``can_*`` may be read without the lock, as hints)."""
        return self._parts.limiter

    # ------------------------------------------------------------------ insert

    def may_insert(self, rows: int) -> bool:
        """Lock-free hint: would the rate limiter (and ``max_size``) admit an insert of ``rows`` now?"""
        return self._parts.limiter.may_insert(rows)

    def insert(self, data: Any, priorities: Any = None) -> torch.Tensor:
        """Append rows; the oldest rows are overwritten once the table is full.

        Args:
            data: mapping (possibly nested) or TensorDict of tensors/arrays whose
                leading dim is rows. Must match the schema exactly.
            priorities: ``[rows]`` finite priorities >= 0 (prioritized samplers
                only); omitted: each row gets the largest priority seen so far.

        Returns:
            int64 ``[rows]`` ids of the new rows.

        Raises:
            SchemaMismatchError, InvalidArgumentError, InvalidPriorityError,
            NoPrioritiesError: nothing was stored.
            InsufficientMemoryError: the first insert's rows at the table's
                capacity need more memory than the server may give it.
            RateLimitedError: the rate limiter holds the insert back now.

        Cost: one copy of the rows into storage plus the sampler's insert (O(rows * log
        capacity) at worst)."""
        ids = self._insert(data, priorities, None)
        assert ids is not None  # blocking: the lock was waited for
        return ids

    def insert_now(self, data: Any, priorities: Any = None) -> torch.Tensor | None:
        """:meth:`insert` if it is quick now, else ``None`` having stored nothing: for a
        caller that must never wait (the service's event loop, for a few rows). Quick: the
        table's storage is allocated and writes in place in host memory (no device, disk
        or compressed column: :attr:`ColumnStorage.quick_writes`) and its lock is free this
        instant. Raises as :meth:`insert` (RateLimitedError included: nothing stored)."""
        if not self.quick_to_write():  # a look first: nothing prepared
            return None
        return self._insert(data, priorities, None, now=True)

    def insert_now_durable(self, data: Any, priorities: Any,
                           durable: Callable[[BaseException | None], None],
                           ) -> tuple[torch.Tensor, bool] | None:
        """:meth:`insert_now` for a caller that can wait, without blocking, for the insert to be
        durable: ``(ids, waits)``, or ``None`` having stored nothing. ``waits``: stored, not yet
        acknowledged: ``durable(error)`` is called (any thread, perhaps before this returns)
        once it may be (``None``) or with the error to answer. A table without a log never waits."""
        ids = self.insert_now(data, priorities)
        return None if ids is None else (ids, False)

    def quick_to_write(self) -> bool:
        """Lock-free look: may :meth:`insert_now` take an insert (:attr:`ColumnStorage.quick_writes`)?"""
        storage = self._parts.storage
        return storage is not None and storage.quick_writes

    def replay_insert(self, data: Any, priorities: Any, first_id: int) -> torch.Tensor:
        """An insert replayed from a write-ahead log (:mod:`replay_server.checkpoint.wal.replay`):
        as :meth:`insert`, its rows getting ids from ``first_id`` on (the ids the logged run
        gave them), and not asking the rate limiter (the insert was admitted when logged).

        Raises:
            ValueError: ``first_id`` cannot be the next row's id in any history of id
                segments. Otherwise as :meth:`insert`.
        """
        ids = self._insert(data, priorities, first_id)
        assert ids is not None
        return ids

    def resume_ids(self) -> None:
        """After a log replay: new rows get the ids of this run's incarnation."""
        with self._lock:
            self._parts.ids.resume(self._parts.ring.next_id)

    def prepare_insert(self, data: Any, priorities: Any = None) -> InsertRows:
        """What :meth:`insert` does before its lock (check, convert, compress), for a caller
        ordering inserts under a lock of its own (the log's): pass it to :meth:`insert`."""
        parts = self._parts
        batch = InsertRows.of(data, priorities, self.config, parts.sampler.alpha, self._device)
        return replace(batch, early=parts.encode_early(batch.columns, self.name))

    def _insert(self, data: Any, priorities: Any, first_id: int | None,
                now: bool = False) -> torch.Tensor | None:
        """:meth:`insert` (``data``: rows, or :meth:`prepare_insert`'s); ``first_id``:
        :meth:`replay_insert`'s; ``now``: :meth:`insert_now`'s (``None`` if the lock is
        taken, or the storage, as found under it, is not quick to write)."""
        batch = data if isinstance(data, InsertRows) else self.prepare_insert(data, priorities)
        early = batch.early
        lock = self._lock
        if not lock.acquire(not now):  # a plain acquire: every insert passes here
            return None
        try:
            parts = self._parts
            if now and (parts.storage is None or not parts.storage.quick_writes):
                return None  # a reset since the look in insert_now: never allocate here
            batch.check_alpha(parts.sampler.alpha, self.name)  # draw_settings may change it
            checked = early is not None and early[0] is parts.storage and early[1] is parts.schema
            schema = parts.schema if checked else self._schema_for(parts, batch)
            assert schema is not None
            rows, ring = batch.rows, parts.ring
            if rows == 0:
                return torch.empty(0, dtype=torch.int64)
            if rows > ring.capacity:
                raise InvalidArgumentError(
                    f"table {self.name!r}: an insert of {rows} rows exceeds the table's "
                    f"capacity of {ring.capacity} rows; split it"
                )
            if first_id is None:
                parts.limiter.check_insert(rows, self.name)
            else:
                parts.ids.follow(ring.next_id, first_id)
            parts.ids.reserve(ring.next_id, rows)
            storage = self._storage_for(parts, schema)
            encoded = early[2] if checked and early is not None else \
                storage.encode(parts.stored(batch.columns))
            storage.reserve(ring.next_id % ring.capacity, encoded)  # may refuse: nothing changed
            first_row_id = self._append(parts, batch, encoded,
                                        batch.episodes(self.config) if self._episodes else {})
            self.changes.tick()
        finally:
            lock.release()
        return torch.from_numpy(ring.range(first_row_id, rows))

    def _schema_for(self, parts: TableParts, batch: InsertRows) -> Schema:
        """The schema ``batch`` must match (the one it fixes, if it is the first insert), having
        checked that it does. Under the lock.

        Raises:
            SchemaMismatchError, InvalidArgumentError: naming the key, and the way out.
        """
        schema = parts.schema
        if schema is None:
            schema = schema_of(batch.columns, self.name)
            check_sampler_columns(self.config, schema)
        try:
            schema.check(batch.columns, self.name)
        except SchemaMismatchError as exc:
            raise SchemaMismatchError(f"{exc}; {schema_way_out(self.config)}") from None
        return schema

    def _storage_for(self, parts: TableParts, schema: Schema) -> ColumnStorage:
        """The table's storage, allocated for ``schema`` by the first insert. Under the lock.

        Raises:
            InsufficientMemoryError: the rows at the table's capacity need more memory
                than the server may give it.
        """
        if parts.storage is None:
            self._memory.promise_rows(schema)
            parts.allocate(schema, self.config, self._memory.growth(schema))
        assert parts.storage is not None
        return parts.storage

    @staticmethod
    def _append(parts: TableParts, batch: InsertRows, encoded: Any,
                episodes: dict[str, Any]) -> int:
        """Append checked rows whose storage is reserved: the ring, then each layer told once,
        in order, then counters and rate limiter; the first new row's id. Under the lock;
        nothing here refuses."""
        ring, storage, rows = parts.ring, parts.storage, batch.rows
        assert storage is not None
        evicted_first_id = ring.first_live
        first_id, evicted = ring.allocate(rows)
        first_row_id = parts.ids.id_of(first_id)
        event = InsertEvent(first_id=first_id, count=rows, evicted_first_id=evicted_first_id,
                            evicted=evicted, priorities=batch.priorities, **episodes)
        deleted = evicted
        if parts.remover is not None:  # rows retired before were deleted then
            deleted -= parts.remover.inserted(event.ids, event.evicted_ids)
        for reader in parts.readers:
            reader.before_write(event)
        storage.write(first_id % ring.capacity, encoded)
        for reader in parts.readers:
            reader.after_write(event, batch.columns)
        parts.sampler.insert(event)
        parts.counters.inserted += rows
        parts.counters.evicted += evicted
        parts.limiter.inserted(rows)
        parts.limiter.deleted(deleted)
        return first_row_id

    # ------------------------------------------------------------------ sample

    def sample(
        self, batch_size: int, *, out: Mapping[str, torch.Tensor] | None = None,
        lease: LeaseRequest | None = None,
    ) -> SampleBatch:
        """Draw ``batch_size`` rows (or slices) with replacement, per the table's sampler.

        ``lease`` (tables whose sampler consumes its rows; ignored elsewhere): take the rows
        under that lease (:mod:`replay_server.engine.leases`); a lease held answers again.
        ``out`` (flat key -> contiguous tensor shaped like that column of the batch:
        :meth:`batch_layout`) receives the rows instead of new tensors: a learner's staging
        buffer. A device table gathers on its device: without ``out`` the whole batch is
        there; host ``out`` tensors get one copy of the rows.

        Raises:
            InvalidArgumentError: ``batch_size`` is not an integer in [1, MAX_BATCH_SIZE],
                larger than ``max_times_sampled`` can ever serve, or ``out`` does not fit.
            EmptyTableError: nothing can be sampled yet.
            RateLimitedError: the rate limiter (or ``max_times_sampled``) holds the sample
                back now. The limiter counts ``batch_size * slice_len`` rows for slices.

        Cost: the sampler's draw (see its docstring) plus one gather per column.
        """
        batch_size = batch_size_of(batch_size, self.name)
        schema = self._parts.schema
        if out is not None and schema is not None:
            problem = schema.out_problem(self._lead(batch_size), out)
            if problem:
                raise InvalidArgumentError(f"table {self.name!r}: {problem}")
        rows = batch_size * (self.config.slice_len or 1)
        leased = lease is not None and self.config.sampler.traits.consumes
        with self._lock:
            parts = self._parts
            parts.settle_leases()
            held = parts.leases.held(lease.name, parts.ring) if lease and leased else None
            if held is not None:  # a retry of a sample whose answer was lost: the same rows
                return parts.drawn_from.place(batch_of(parts, held.index, held.mass, out), out)
            parts.limiter.check_sample(rows, self.name)
            index, mass = draw(parts, batch_size, lease if leased else None, self.name)
            parts.counters.sample_calls += 1
            parts.counters.sampled += batch_size
            parts.limiter.sampled(rows)
            self.changes.tick()
            batch = batch_of(parts, index, mass, out)
            storage = parts.drawn_from
        return storage.place(batch, out)

    def settle_leases(self, acknowledge: Iterable[str] = (), give_back: Iterable[str] = (),
                      acknowledge_first: tuple[str, int] | None = None) -> int:
        """Acknowledge leases (their rows are gone for good; ``acknowledge_first``: a lease
        name and how many of its first draws), give others back (their taker went away),
        and return the rows of expired ones to the queue. Unknown names are ignored.
        Returns the rows that came back. See :mod:`replay_server.engine.leases`."""
        with self._lock:
            back = self._parts.settle_leases(acknowledge, give_back, acknowledge_first)
            if back:
                self.changes.tick()
        return back

    def batch_layout(self, batch_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Flat key -> (dtype, shape) of each column of a batch of ``batch_size`` ({} before a schema)."""
        schema = self._parts.schema
        if schema is None:
            return {}
        lead = self._lead(batch_size)
        return {**schema.batch_layout(lead), **self._parts.top.extra_layout(lead)}

    def batch_nbytes(self, batch_size: int) -> int:
        """Bytes of a batch of ``batch_size``, extras included (0 before a schema)."""
        schema = self._parts.schema
        if schema is None:
            return 0
        return batch_nbytes(schema.row_bytes, batch_size, self.config.slice_len,
                            self.config.n_step)

    def _lead(self, batch_size: int) -> tuple[int, ...]:
        slice_len = self.config.slice_len
        return (batch_size,) if slice_len is None else (batch_size, slice_len)

    # -------------------------------------------------------------- priorities

    def update_priorities(self, ids: Any, priorities: Any, *, blocking: bool = True) -> int | None:
        """Set the priorities of the rows named by ``ids``; ids of rows no longer stored are
        stale: ignored and counted in ``stale_priority_updates`` (for a repeated id, the last
        priority wins; whole slices where the config mixes priorities per slice: see
        :mod:`~replay_server.engine.priority_update`).

        Args:
            ids: int64 ids, any shape.
            priorities: finite values >= 0, same shape as ``ids``.
            blocking: ``False``: if another call holds the table's lock, return
                ``None`` at once having done nothing (for a caller that must
                never wait, such as the service's event loop).

        Returns:
            How many of ``ids`` named rows still present (and were applied).

        Raises:
            NoPrioritiesError: the sampler has no priorities.
            InvalidIdsError: ids are not int64, negative, of another shard, or
                never issued by this table (see :mod:`~replay_server.engine.id_space`).
            InvalidPriorityError: a priority is negative or not finite, or the
                shapes differ. Nothing is applied.

        Cost: O(n * log capacity).
        """
        if not self.config.sampler.traits.priorities:
            raise NoPrioritiesError(f"table {self.name!r} uses sampler "
                                    f"{self.config.sampler.value!r}, which has no priorities to update")
        update = PriorityUpdate.of(ids, priorities, self.config, self._parts.sampler.alpha or 0.0)
        with _holding(self._lock, blocking) as held:
            if not held:
                return None
            parts = self._parts
            taken, applied = update.present(parts.ring, parts.ids, parts.remover, self.name)
            try:
                if taken is not None:
                    parts.sampler.update(*taken)
            except InvalidPriorityError as exc:  # a slice that is not one: nothing applied
                raise InvalidPriorityError(f"table {self.name!r}: {exc}") from None
            parts.counters.priority_updates += applied
            parts.counters.stale_priority_updates += update.size - applied
            self.changes.tick()
        return applied

    def update_priorities_now_durable(self, ids: Any, priorities: Any,
                                      durable: Callable[[BaseException | None], None],
                                      ) -> tuple[int, bool] | None:
        """``update_priorities(blocking=False)`` as :meth:`insert_now_durable` is :meth:`insert_now`."""
        applied = self.update_priorities(ids, priorities, blocking=False)
        return None if applied is None else (applied, False)

    def read_rows(self, *, positions: Any = None, ids: Any = None, columns: bool = True,
                  priorities: bool = False) -> RowRead:
        """The stored rows at storage ``positions`` (TorchRL's ``rb[index]``) or named by
        ``ids``, as stored; changes nothing (:func:`.row_access.read` says what it raises)."""
        with self._lock:
            return row_access.read(self._parts, self.config, positions=positions, ids=ids,
                                   columns=columns, priorities=priorities)

    def live_positions(self) -> np.ndarray:
        """The storage positions of the live rows, oldest first (a scale down's hand-over)."""
        with self._lock:
            ring = self._parts.ring
            return ring.slots(ring.range(ring.first_live, ring.size))

    def write_rows(self, positions: Any, data: Any) -> None:
        """Overwrite whole stored rows in place, by storage position (TorchRL's
        ``rb[index] = data``; :func:`.row_access.write` says what it refuses). The data is
        checked and converted before the lock."""
        columns = columns_of(data, self.name, self.config.episode_key, self._device)
        with self._lock:
            row_access.write(self._parts, self.config, positions, columns)
            self.changes.tick()

    def set_sampling(self, alpha: float | None = None, beta: float | None = None,
                     seed: int | None = None) -> tuple[float, float]:
        """How the table draws from its next sample on (``None``: unchanged); returns the
        ``(alpha, beta)`` in force. See :mod:`replay_server.engine.draw_settings`."""
        draw_settings.check(self.config, alpha, beta, seed)
        with self._lock:
            in_force = draw_settings.set_sampling(self._parts, self.config, alpha, beta, seed)
            self.changes.tick()
        return in_force

    # ------------------------------------------------------------------- admin

    def delete(self, ids: Any) -> int:
        """Remove the rows named by ``ids`` from sampling, as if handed out their last time
        (tables whose rows leave when sampled: ``fifo``/``lifo``, or ``max_times_sampled``).
        Ids of rows already taken, deleted, retired or overwritten are stale and ignored;
        a repeated id counts once. Inserts waiting for room under ``max_size`` may pass.

        Returns:
            How many of ``ids`` named rows present (and were removed).

        Raises:
            InvalidArgumentError: the table's rows do not leave when sampled.
            InvalidIdsError: ids are not int64, negative, of another shard, or
                never issued by this table. Nothing is removed.

        Cost: O(n log n) for n ids, plus the sampler's delete.
        """
        if self.config.removal_limit == 0:
            raise InvalidArgumentError(
                f"table {self.name!r} uses sampler {self.config.sampler.value!r} without "
                f"max_times_sampled, whose rows stay until the ring overwrites them; delete "
                f"is supported where rows leave when sampled (sampler 'fifo' or 'lifo', or "
                f"max_times_sampled)")
        id_array = id_values(ids, self.name).reshape(-1)
        with self._lock:
            parts = self._parts
            assert parts.remover is not None
            positions = parts.ids.positions_of(id_array, parts.ring.next_id, self.name)
            positions = np.unique(positions[parts.ring.live(positions)])
            deleted = parts.remover.delete(parts.sampler, positions)
            parts.counters.deleted += deleted
            parts.limiter.deleted(deleted if parts.remover.removes_rows else 0)
            self.changes.tick()
        return deleted

    def reset(self, *, schema: bool = False) -> None:
        """Remove every row. Ids keep counting (old ids become stale).

        Args:
            schema: also forget the schema the first insert fixed, and free its
                storage: the next insert fixes a new one. A table whose config
                declares its schema keeps the declared one (and its storage).
        """
        with self._lock:
            parts = self._parts
            if schema and self.config.schema is None and parts.schema is not None:
                parts.forget_schema()
                self._memory.promise_state()  # smaller than the promise it replaces: never refused
            parts.clear()
            self.changes.tick()

    def info(self) -> TableInfo:
        """A consistent snapshot of sizes, counters and sampler figures."""
        with self._lock:
            return self._parts.info(self.config)

    def figures(self) -> TableFigures:
        """Size, capacity, bytes stored and counters, read WITHOUT the lock (see
        :class:`~replay_server.engine.table_info.TableFigures`). O(1); never blocks."""
        parts = self._parts
        storage = parts.storage
        return TableFigures(size=parts.size, capacity=parts.ring.capacity,
                            storage_bytes=0 if storage is None else storage.nbytes,
                            counters=replace(parts.counters))

    # ------------------------------------------------------------ persistence

    def snapshot(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TableSnapshot:
        """Begin a consistent snapshot of the table as it is now (:mod:`replay_server.engine.snapshot`).

        Copies everything but the rows under the lock (O(slots used) of small
        per-slot sampler arrays, into memory touched before the lock); the rows
        are read out afterwards in pieces of ``chunk_bytes``, under short lock
        holds. Close the snapshot when done.
        """
        snapshot, self._instant_bytes = snapshot_parts(
            self.config, self._parts, self._lock, self._instant_bytes, chunk_bytes)
        return snapshot

    def state_dict(self) -> dict[str, Any]:
        """A consistent snapshot of the whole table: tensors and plain values only.

        Loadable with ``torch.load(..., weights_only=True)``; no code runs on
        load. ``"columns"``: the slots ever written, in slot order, copied in
        pieces under short lock holds (:meth:`snapshot`).
        """
        with self.snapshot() as snap:
            if snap.rows is not None:
                snap.state["columns"] = snap.rows.columns()
        return snap.state

    def load_state_dict(
        self, state: Mapping[str, Any], read_rows: Callable[[dict], None] | None = None
    ) -> None:
        """Replace this table's contents with a :meth:`state_dict`, all or nothing; ``read_rows``:
        what fills the rows instead of ``state["columns"]`` (see
        :func:`~replay_server.engine.table_state.load_parts`, which says what it raises)."""
        parts = load_parts(self.config, state, self._parts, read_rows, self._incarnations,
                           self._memory.ledger)
        with self._lock:
            self._parts = parts
            self.changes.tick()


@contextmanager
def _holding(lock: threading.Lock, blocking: bool) -> Iterator[bool]:
    """Hold ``lock`` for the block; with ``blocking=False`` only if it is free (yields whether held)."""
    held = lock.acquire(blocking)
    try:
        yield held
    finally:
        if held:
            lock.release()
