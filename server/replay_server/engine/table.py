"""A table: a fixed-capacity FIFO ring of rows, stored column-wise, with one sampler.

Rows go in through :meth:`Table.insert` (leading dim = rows) and get int64 ids
that are never issued twice, not even across crashes (see
:mod:`replay_server.engine.id_space`; inside, rows are counted by position:
:mod:`replay_server.engine.ids`); samples come out as
:class:`~replay_proto.batch.SampleBatch`; priorities are updated by id. The
table is the only orchestrator: under its lock it writes storage and tells
its sampler exactly once. What it is handed is checked and converted before
the lock (:mod:`~replay_server.engine.inputs`); its state is saved and loaded
by :mod:`~replay_server.engine.table_state`; everything it mutates is one
:class:`~replay_server.engine.table_parts.TableParts`.

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
from replay_server.engine.change_clock import ChangeClock
from replay_server.engine.config import TableConfig
from replay_server.engine.id_space import IncarnationSource
from replay_server.engine.inputs import (
    MAX_BATCH_SIZE,
    batch_size_of,
    check_sampler_columns,
    columns_of,
    episode_values,
    id_values,
    insert_priorities,
    priority_values,
    row_count,
    slice_rows,
)
from replay_server.engine.memory import MemoryLedger
from replay_server.engine.readers.framestack import check_insert as check_stacks
from replay_server.engine.storage.placement import table_device
from replay_server.engine.rate_limiter import RateLimiter
from replay_server.engine.insert_event import InsertEvent
from replay_server.engine.leases import LeaseRequest
from replay_server.engine.schema import Schema, schema_of
from replay_server.engine.snapshot import DEFAULT_CHUNK_BYTES, TableSnapshot
from replay_server.engine.table_info import TableCounters, TableFigures, TableInfo
from replay_server.engine.table_parts import (
    TableParts,
    fresh_parts,
    memory_promise,
    schema_way_out,
    table_bytes,
)
from replay_server.engine.table_state import STATE_VERSION, load_parts, snapshot_parts
from replay_server.errors import (
    EmptyTableError,
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
        self._memory = memory or MemoryLedger()
        declared = None if config.schema is None else Schema(config.schema)
        try:
            self._memory.require(config.name, table_bytes(config, declared),
                                 f"capacity {config.capacity:,} (sampler state"
                                 f"{'' if declared is None else ' and the declared schema'})")
            self._parts = fresh_parts(config, incarnations, memory_promise(config, self._memory))
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

        Cost: one copy of the rows into storage plus the sampler's insert
        (O(rows * log capacity) at worst).
        """
        columns = columns_of(data, self.name, self.config.episode_key, self._device)
        rows = row_count(columns, self.name)
        if self.config.frame_stack_key is not None:
            check_stacks(columns, self.config.frame_stack_key, self.name)
        alpha = self._parts.sampler.alpha
        checked_priorities = insert_priorities(priorities, rows, self.config, alpha)
        early = self._parts.encode_early(columns, self.name)
        with self._lock:
            parts = self._parts
            if checked_priorities is not None and parts.sampler.alpha != alpha:
                # alpha changed meanwhile (draw_settings): the bound on priorities with it
                insert_priorities(priorities, rows, self.config, parts.sampler.alpha)
            schema = parts.schema
            if schema is None:
                schema = schema_of(columns, self.name)
                check_sampler_columns(self.config, schema)
            try:
                schema.check(columns, self.name)
            except SchemaMismatchError as exc:
                raise SchemaMismatchError(f"{exc}; {schema_way_out(self.config)}") from None
            if rows == 0:
                return torch.empty(0, dtype=torch.int64)
            ring = parts.ring
            if rows > ring.capacity:
                raise InvalidArgumentError(
                    f"table {self.name!r}: an insert of {rows} rows exceeds the table's "
                    f"capacity of {ring.capacity} rows; split it"
                )
            parts.limiter.check_insert(rows, self.name)
            parts.ids.reserve(ring.next_id, rows)
            if parts.storage is None:
                self._memory.require(self.name, table_bytes(self.config, schema),
                                     f"capacity {ring.capacity:,} x {schema.row_bytes:,} bytes "
                                     f"per row ({schema.describe()})")
                parts.allocate(schema, self.config, memory_promise(self.config, self._memory)(
                    schema))
            storage = parts.storage
            assert storage is not None
            encoded = early[1] if early is not None and early[0] is storage else \
                storage.encode(parts.stored(columns))
            storage.reserve(ring.next_id % ring.capacity, encoded)  # may refuse: nothing changed
            episodes = episode_values(columns, rows, self.config) if self._episodes else {}
            first_row_id = self._append(parts, columns, encoded, rows, checked_priorities,
                                        episodes)
            self.changes.tick()
        return torch.from_numpy(ring.range(first_row_id, rows))

    @staticmethod
    def _append(parts: TableParts, columns: Mapping[str, torch.Tensor], encoded: Any,
                rows: int, priorities: Any, episodes: dict[str, Any]) -> int:
        """Append checked rows whose storage is reserved: the ring, then each layer told once,
        in order, then counters and rate limiter; the first new row's id. Under the lock;
        nothing here refuses."""
        ring, storage = parts.ring, parts.storage
        assert storage is not None
        evicted_first_id = ring.first_live
        first_id, evicted = ring.allocate(rows)
        first_row_id = parts.ids.id_of(first_id)
        event = InsertEvent(first_id=first_id, count=rows, evicted_first_id=evicted_first_id,
                            evicted=evicted, priorities=priorities, **episodes)
        deleted = evicted
        if parts.remover is not None:  # rows retired before were deleted then
            deleted -= parts.remover.inserted(event.ids, event.evicted_ids)
        for reader in parts.readers:
            reader.before_write(event)
        storage.write(first_id % ring.capacity, encoded)
        for reader in parts.readers:
            reader.after_write(event, columns)
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

        ``lease`` (tables whose sampler consumes its rows; ignored elsewhere):
        take the rows under that lease (:mod:`replay_server.engine.leases`);
        a lease of that name still held answers with its rows again.

        ``out`` (flat key -> contiguous tensor shaped like that column of the
        batch) receives the rows instead of new tensors: a learner's pinned or
        shared-memory staging buffer (see :meth:`batch_layout`).

        A device table (``device = "cuda"``) gathers on its device: without
        ``out`` the whole batch (ids, weights and probabilities too) is on
        that device; host ``out`` tensors receive one copy of the rows, and
        the extras stay on the host.

        Raises:
            InvalidArgumentError: ``batch_size`` is not an integer in [1, MAX_BATCH_SIZE],
                larger than ``max_times_sampled`` can ever serve, or ``out`` does
                not fit the batch.
            EmptyTableError: nothing can be sampled yet.
            RateLimitedError: the rate limiter (or ``max_times_sampled``) holds the
                sample back now. The limiter counts ``batch_size * slice_len`` rows
                for slice samplers.

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
                return parts.drawn_from.place(self._read(parts, held.index, held.mass, out), out)
            parts.limiter.check_sample(rows, self.name)
            retired = gone = 0
            mass = parts.sampler.mass()  # what this draw's probabilities are relative to
            try:
                if parts.remover is None:
                    index = parts.sampler.sample(batch_size, parts.generator)
                else:
                    index, removals = parts.remover.sample(
                        parts.sampler, batch_size, parts.generator, self.name,
                        can_wait=parts.limiter.enabled)
                    retired = sum(removal.positions.size for removal in removals)
                    gone = retired if parts.remover.removes_rows else 0
            except EmptyTableError as exc:
                raise EmptyTableError(f"table {self.name!r}: {exc}") from None
            if leased:
                assert lease is not None
                parts.leases.hold(lease, index, removals, mass)
            parts.counters.sample_calls += 1
            parts.counters.sampled += batch_size
            parts.limiter.sampled(rows)
            parts.counters.retired += retired
            parts.limiter.deleted(gone)
            self.changes.tick()
            batch = self._read(parts, index, mass, out)
            storage = parts.drawn_from
        return storage.place(batch, out)

    @staticmethod
    def _read(parts: TableParts, index: Any, mass: Any,
              out: Mapping[str, torch.Tensor] | None) -> SampleBatch:
        """The batch of a drawn ``index``, not yet placed (under the lock)."""
        assert parts.storage is not None
        columns = parts.top.read(index.ids, None, out, index.slots)
        ids = parts.ids.ids_of(index.ids, parts.ring.first_live)
        return SampleBatch.from_columns(columns, torch.from_numpy(ids),
                                        torch.from_numpy(index.weights),
                                        torch.from_numpy(index.probabilities), mass)

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
        """Set the priorities of the rows named by ``ids``.

        Ids whose rows have since been overwritten (or reset, or retired), and
        ids of a run that crashed after its last checkpoint, are *stale*:
        ignored and counted in ``stale_priority_updates``; they never touch
        a newer row. For a repeated id, the last priority wins. With the
        config's ``priority_mixing``, ids are a batch's slices (``[B, slice_len]``,
        or flat, ``slice_len`` per slice in order), each checked to be a slice
        as sampled, and each slice's start gets the mix of its steps'
        priorities; a slice counts as applied (all its ids) when its start is
        present.

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
            raise NoPrioritiesError(
                f"table {self.name!r} uses sampler {self.config.sampler.value!r}, which has "
                f"no priorities to update"
            )
        id_array = id_values(ids, self.name)
        values = priority_values(priorities, self.name, self._parts.sampler.alpha or 0.0)
        if values.shape != id_array.shape:
            raise InvalidPriorityError(
                f"table {self.name!r}: priorities must have the same shape as ids "
                f"{list(id_array.shape)}, got {list(values.shape)}"
            )
        mixing = self.config.priority_mixing is not None
        if mixing:  # whole slices [B, slice_len], mixed into their starts by the sampler
            id_array, values = slice_rows(id_array, values, self.config, self.name)
        else:
            id_array, values = id_array.reshape(-1), values.reshape(-1)
        with _holding(self._lock, blocking) as held:
            if not held:
                return None
            parts = self._parts
            ring = parts.ring
            positions = parts.ids.positions_of(id_array.reshape(-1), ring.next_id,
                                               self.name).reshape(id_array.shape)
            heads = positions[:, 0] if mixing else positions  # a slice stays while its start does
            # Positions are issued in order, so when the lowest is live they all are.
            lowest = int(heads.min()) if heads.size else ring.first_live
            live = None if lowest >= ring.first_live else ring.live(heads)
            if parts.remover is not None and parts.remover.removes_rows:  # retired: stays 0
                drawable = parts.remover.drawable(heads)
                live = drawable if live is None else live & drawable
            present = heads.size if live is None else int(live.sum())
            try:
                if present == heads.size:
                    parts.sampler.update(positions, values)
                elif present:
                    parts.sampler.update(positions[live], values[live])
            except InvalidPriorityError as exc:  # a slice that is not one: nothing applied
                raise InvalidPriorityError(f"table {self.name!r}: {exc}") from None
            applied = present * (id_array.size // max(1, heads.size))
            parts.counters.priority_updates += applied
            parts.counters.stale_priority_updates += id_array.size - applied
            self.changes.tick()
        return applied

    def under_lock(self, fn: Callable[..., Any], *args: Any, change: bool = True,
                   **kwargs: Any) -> Any:
        """``fn(parts, config, *args, **kwargs)`` under the lock, ticking :attr:`changes` if
        ``change``: how engine modules act on the parts (:mod:`.row_access`, :mod:`.draw_settings`)."""
        with self._lock:
            result = fn(self._parts, self.config, *args, **kwargs)
            if change:
                self.changes.tick()
        return result

    # ------------------------------------------------------------------- admin

    def delete(self, ids: Any) -> int:
        """Remove the rows named by ``ids`` from sampling: they leave the table as if
        handed out their last time. For tables whose rows leave when sampled (the
        remover's: ``fifo``/``lifo``, or ``max_times_sampled``).

        Ids of rows already taken, deleted, retired or overwritten are stale
        and ignored (the ids not counted in the result). A repeated id counts
        once. Inserts waiting for room under ``max_size`` may pass afterwards.

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
                # smaller than the promise it replaces, so it is never refused
                self._memory.require(self.name, table_bytes(self.config, None),
                                     f"capacity {self.config.capacity:,} (sampler state)")
            parts.ring.clear()
            parts.leases.clear()
            parts.sampler.clear()
            parts.limiter.reset()
            if parts.remover is not None:
                parts.remover.clear()
            for reader in parts.readers:
                reader.clear()
            parts.counters.resets += 1
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
        """Replace this table's contents with a :meth:`state_dict`, all or nothing.

        The state is loaded into fresh parts first and swapped in only once
        it has loaded completely, so a malformed state changes nothing (the
        cost: twice the table's memory while loading, except for a table that
        never held a row, whose storage is loaded into). ``read_rows``, if
        given, fills the rows instead of ``state["columns"]``: it is called
        with numpy views of the fresh table's whole columns (bfloat16 as
        int16), e.g. to read them from files; what it raises propagates as is.

        Raises:
            ConfigError: the state has another layout version, contradicts this
                table's config (capacity, sampler, slice_len, alpha, keys) or
                schema (the message names both values), or was saved by another shard.
            MalformedStateError: the state is malformed.
            InsufficientMemoryError: the saved schema at the table's capacity
                needs more memory than the server may give it.
        """
        # A table that never held a row (one made to be restored) lends its storage: its
        # contents do not matter, and a restore then needs no second copy (memmap: on disk).
        reuse = self._parts.storage if self._parts.ring.next_id == 0 else None
        parts: TableParts = load_parts(self.config, state, self._parts.schema, read_rows is None,
                                       self._incarnations, self._memory, reuse)
        if read_rows is not None and parts.storage is not None:
            views = parts.storage.load_views()
            read_rows(views)
            parts.storage.loaded(views)
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
