"""A table: a fixed-capacity FIFO ring of rows, stored column-wise, with one sampler.

Rows go in through :meth:`Table.insert` (leading dim = rows) and get int64 ids
(see :mod:`replay_server.ids`); samples come out as
:class:`~replay_proto.batch.SampleBatch`; priorities are updated by id. The
table is the only orchestrator: under its lock it validates, writes storage
and tells its sampler exactly once.

Every method either succeeds or raises a
:class:`~replay_server.errors.ReplayServerError` having changed nothing.

Flow control: the table's :class:`~replay_server.ratelimit.RateLimiter` is
consulted under the lock by ``insert`` and ``sample``; a call it holds back
raises :class:`~replay_server.errors.RateLimitedError` at once (the service
layer turns that into waiting). ``max_times_sampled`` retires rows (see
:mod:`replay_server.retirement`).

Thread-safety: all public methods may be called from any thread; one lock per
table serializes them (tables do not block each other). Tensor conversion of
inputs happens before the lock is taken, the copies in and out under it.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_proto.keys import unflatten
from replay_server.config import TableConfig
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    InvalidIdsError,
    InvalidPriorityError,
    MalformedStateError,
    NoPrioritiesError,
    SchemaMismatchError,
)
from replay_server.ids import IdRing
from replay_server.inputs import as_tensor, columns_of, row_count
from replay_server.ratelimit import RateLimiter
from replay_server.retirement import Retirement, load_retirement
from replay_server.rng import generator_from_state, generator_state
from replay_server.samplers import InsertEvent, make_sampler
from replay_server.schema import FieldSpec, Schema
from replay_server.snapshot import DEFAULT_CHUNK_BYTES, Arena, TableSnapshot
from replay_server.storage import ColumnStorage
from replay_server.table_info import TableCounters, TableInfo

STATE_VERSION = 1
"""Version of :meth:`Table.state_dict`'s layout; bumped on any incompatible change."""

MAX_BATCH_SIZE = 1 << 24
"""Largest ``batch_size`` a single sample may ask for."""

_LOG_FLOAT32_MAX = math.log(float(torch.finfo(torch.float32).max))
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class Table:
    """A named replay table. See the module docstring for the concepts.

    Args:
        config: the table's validated configuration.

    Raises:
        ConfigError: the declared schema cannot serve the sampler (e.g. a slice
            table without an integer episode column), or pinned memory was
            requested without an accelerator.
    """

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._ring = IdRing(config.capacity)
        self._sampler = make_sampler(config, self._ring)
        # numpy's PCG64: single-threaded draws, and a state of plain integers to save.
        self._generator = np.random.Generator(np.random.PCG64(config.seed))
        self._counters = TableCounters()
        self._limiter = RateLimiter.from_config(config)
        self._retirement = (
            Retirement(config.capacity, config.max_times_sampled) if config.max_times_sampled
            else None
        )
        # The largest priority whose mass p ** alpha fits the float32 sum tree.
        self._max_priority = (
            math.exp(_LOG_FLOAT32_MAX / config.alpha) if config.alpha > 0 else math.inf
        )
        self._schema: Schema | None = None
        self._storage: ColumnStorage | None = None
        if config.schema is not None:
            schema = Schema(config.schema)
            try:
                self._check_sampler_columns(schema)
            except SchemaMismatchError as exc:
                raise ConfigError(str(exc)) from None
            self._allocate(schema)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def schema(self) -> Schema | None:
        """The columns, fixed by the config or the first insert (``None`` before)."""
        return self._schema

    @property
    def size(self) -> int:
        """Rows present (retired rows excluded)."""
        return self._ring.size - (self._retirement.retired if self._retirement else 0)

    @property
    def rate_limiter(self) -> RateLimiter:
        """The table's rate limiter (``can_*`` may be read without the lock, as hints)."""
        return self._limiter

    # ------------------------------------------------------------------ insert

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
            RateLimitedError: the rate limiter holds the insert back now.

        Cost: one copy of the rows into storage plus the sampler's insert
        (O(rows * log capacity) at worst).
        """
        columns = columns_of(data, self.name)
        rows = row_count(columns, self.name)
        checked_priorities = self._insert_priorities(priorities, rows)
        with self._lock:
            schema = self._schema
            if schema is None:
                schema = Schema({k: FieldSpec.of_column(c) for k, c in columns.items()})
                self._check_sampler_columns(schema)
            schema.check(columns, self.name)
            if rows == 0:
                return torch.empty(0, dtype=torch.int64)
            if rows > self._ring.capacity:
                raise InvalidArgumentError(
                    f"table {self.name!r}: an insert of {rows} rows exceeds the table's "
                    f"capacity of {self._ring.capacity} rows; split it"
                )
            self._limiter.check_insert(rows, self.name)
            if self._storage is None:
                self._allocate(schema)
            assert self._storage is not None
            event = self._insert_event(columns, rows, checked_priorities)
            evicted_first_id = self._ring.first_live
            first_id, evicted = self._ring.allocate(rows)
            deleted = evicted
            if self._retirement is not None:
                ring = self._ring
                deleted -= self._retirement.inserted(
                    ring.slots(ring.range(first_id, rows)),
                    ring.slots(ring.range(evicted_first_id, evicted)),
                )
            self._storage.write(first_id % self._ring.capacity, columns)
            self._sampler.insert(
                InsertEvent(
                    first_id=first_id,
                    count=rows,
                    evicted_first_id=evicted_first_id,
                    evicted=evicted,
                    **event,
                )
            )
            self._counters.inserted += rows
            self._counters.evicted += evicted
            self._limiter.inserted(rows)
            self._limiter.deleted(deleted)
        return torch.from_numpy(self._ring.range(first_id, rows))

    def _insert_priorities(self, priorities: Any, rows: int) -> np.ndarray | None:
        if priorities is None:
            return None
        if not self.config.sampler.is_prioritized:
            raise NoPrioritiesError(
                f"table {self.name!r} uses sampler {self.config.sampler.value!r}, which has "
                f"no priorities; insert without priorities"
            )
        values = self._priority_values(priorities)
        if tuple(values.shape) != (rows,):
            raise InvalidPriorityError(
                f"table {self.name!r}: priorities must have shape [{rows}] (one per row), "
                f"got {list(values.shape)}"
            )
        return values

    def _priority_values(self, priorities: Any) -> np.ndarray:
        """Priorities as float64 numpy, or an error naming the first bad value."""
        if isinstance(priorities, np.ndarray) and priorities.dtype == np.float64:
            values = priorities  # what the service decodes: no conversion
        else:
            tensor = as_tensor(priorities, "priorities", self.name)
            if tensor.dtype == torch.bool or tensor.is_complex():
                raise InvalidPriorityError(
                    f"table {self.name!r}: priorities must be real numbers, got dtype "
                    f"{tensor.dtype}"
                )
            values = _numpy(tensor).astype(np.float64)
        bad = ~(np.isfinite(values) & (values >= 0))
        if bad.any():
            where = np.flatnonzero(bad)
            first = int(where[0])
            raise InvalidPriorityError(
                f"table {self.name!r}: priorities must be finite and >= 0; {where.size} "
                f"are not (first at index {first}: {float(values.reshape(-1)[first])})"
            )
        alpha = self.config.alpha
        top = float(values.max()) if values.size else 0.0
        if top > self._max_priority:
            raise InvalidPriorityError(
                f"table {self.name!r}: priority {float(values.max())} is too large: its "
                f"sampling mass p**alpha (alpha={alpha}) exceeds float32's range"
            )
        return values

    def _insert_event(
        self, columns: Mapping[str, torch.Tensor], rows: int, priorities: np.ndarray | None
    ) -> dict[str, np.ndarray | None]:
        kind = self.config.sampler
        event: dict[str, np.ndarray | None] = {}
        if kind.is_prioritized:
            event["priorities"] = (
                priorities if priorities is not None else np.full(rows, self._sampler.max_priority)
            )
        if kind.is_slice:
            ends = np.zeros(rows, dtype=bool)
            for key in self.config.episode_end_keys:
                if key in columns:
                    ends |= _numpy(columns[key])
            event["episodes"] = _numpy(columns[self.config.episode_key]).astype(np.int64)
            event["ends"] = ends
        return event

    def _check_sampler_columns(self, schema: Schema) -> None:
        """Slice samplers need an integer episode column and bool end columns, one per row."""
        if not self.config.sampler.is_slice:
            return
        key = self.config.episode_key
        spec = schema.get(key)
        if spec is None or spec.dtype not in _INTEGER_DTYPES or spec.shape != ():
            got = "no such key" if spec is None else spec.describe()
            raise SchemaMismatchError(
                f"table {self.name!r}: sampler {self.config.sampler.value!r} needs key "
                f"{key!r} holding one integer episode id per row (e.g. int64[]), got {got}"
            )
        for key in self.config.episode_end_keys:
            spec = schema.get(key)
            if spec is not None and (spec.dtype != torch.bool or spec.shape != ()):
                raise SchemaMismatchError(
                    f"table {self.name!r}: key {key!r} marks episode ends and must hold one "
                    f"bool per row (bool[]), got {spec.describe()}"
                )

    def _allocate(self, schema: Schema) -> None:
        self._storage = ColumnStorage(schema, self._ring.capacity, pin_memory=self.config.pin_memory)
        self._schema = schema

    # ------------------------------------------------------------------ sample

    def sample(
        self, batch_size: int, *, out: Mapping[str, torch.Tensor] | None = None
    ) -> SampleBatch:
        """Draw ``batch_size`` rows (or slices) with replacement, per the table's sampler.

        ``out`` (flat key -> contiguous tensor shaped like that column of the
        batch) receives the rows instead of new tensors: a learner's pinned or
        shared-memory staging buffer (see :meth:`batch_layout`).

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
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(
            batch_size, (int, np.integer)
        ) or not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise InvalidArgumentError(
                f"table {self.name!r}: batch_size must be an integer in [1, {MAX_BATCH_SIZE}], "
                f"got {batch_size!r}"
            )
        batch_size = operator.index(batch_size)
        if out is not None and self._schema is not None:
            problem = self._schema.out_problem(self._lead(batch_size), out)
            if problem:
                raise InvalidArgumentError(f"table {self.name!r}: {problem}")
        rows = batch_size * (self.config.slice_len or 1)
        with self._lock:
            self._limiter.check_sample(rows, self.name)
            retired = None
            try:
                if self._retirement is None:
                    index = self._sampler.sample(batch_size, self._generator)
                else:
                    index, retired = self._retirement.sample(
                        self._sampler, batch_size, self._generator, self.name,
                        can_wait=self._limiter.enabled)
            except EmptyTableError as exc:
                raise EmptyTableError(f"table {self.name!r}: {exc}") from None
            assert self._storage is not None
            data = self._storage.gather(index.slots, out)
            self._counters.sample_calls += 1
            self._counters.sampled += batch_size
            self._limiter.sampled(rows)
            if retired is not None:
                self._counters.retired += retired.size
                self._limiter.deleted(retired.size)
        return SampleBatch(
            unflatten(data),
            torch.from_numpy(index.ids),
            torch.from_numpy(index.weights),
            torch.from_numpy(index.probabilities),
        )

    def batch_layout(self, batch_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Flat key -> (dtype, shape) of each column of a batch of ``batch_size`` ({} before a schema)."""
        return {} if self._schema is None else self._schema.batch_layout(self._lead(batch_size))

    def _lead(self, batch_size: int) -> tuple[int, ...]:
        slice_len = self.config.slice_len
        return (batch_size,) if slice_len is None else (batch_size, slice_len)

    # -------------------------------------------------------------- priorities

    def update_priorities(self, ids: Any, priorities: Any) -> int:
        """Set the priorities of the rows named by ``ids``.

        Ids whose rows have since been overwritten (or reset) are ignored and
        counted in ``stale_priority_updates``; they never touch the newer row.
        For a repeated id, the last priority wins.

        Args:
            ids: int64 ids, any shape.
            priorities: finite values >= 0, same shape as ``ids``.

        Returns:
            How many of ``ids`` named rows still present (and were applied).

        Raises:
            NoPrioritiesError: the sampler has no priorities.
            InvalidIdsError: ids are not int64, or were never issued by this table.
            InvalidPriorityError: a priority is negative or not finite, or the
                shapes differ. Nothing is applied.

        Cost: O(n * log capacity).
        """
        if not self.config.sampler.is_prioritized:
            raise NoPrioritiesError(
                f"table {self.name!r} uses sampler {self.config.sampler.value!r}, which has "
                f"no priorities to update"
            )
        if isinstance(ids, np.ndarray) and ids.dtype == np.int64:
            id_array = ids  # what the service decodes: no conversion
        else:
            id_tensor = as_tensor(ids, "ids", self.name)
            if id_tensor.dtype != torch.int64:
                raise InvalidIdsError(
                    f"table {self.name!r}: ids must be int64 (as returned by insert and "
                    f"sample), got dtype {id_tensor.dtype}"
                )
            id_array = _numpy(id_tensor)
        values = self._priority_values(priorities)
        if values.shape != id_array.shape:
            raise InvalidPriorityError(
                f"table {self.name!r}: priorities must have the same shape as ids "
                f"{list(id_array.shape)}, got {list(values.shape)}"
            )
        id_array, values = id_array.reshape(-1), values.reshape(-1)
        with self._lock:
            never = (id_array < 0) | (id_array >= self._ring.next_id)
            if never.any():
                raise InvalidIdsError(
                    f"table {self.name!r}: id {int(id_array[never][0])} was never issued by "
                    f"this table (ids so far: 0..{self._ring.next_id - 1}); "
                    f"{int(never.sum())} such ids"
                )
            live = self._ring.live(id_array)
            if self._retirement is not None:  # a retired row's priority stays 0
                live &= self._retirement.drawable(self._ring.slots(id_array))
            applied = int(live.sum())
            if applied == id_array.size:
                self._sampler.update(self._ring.slots(id_array), values)
            elif applied:
                self._sampler.update(self._ring.slots(id_array[live]), values[live])
            self._counters.priority_updates += applied
            self._counters.stale_priority_updates += id_array.size - applied
        return applied

    # ------------------------------------------------------------------- admin

    def reset(self) -> None:
        """Remove every row. Ids keep counting (old ids become stale); the schema stays."""
        with self._lock:
            self._ring.clear()
            self._sampler.clear()
            self._limiter.reset()
            if self._retirement is not None:
                self._retirement.clear()
            self._counters.resets += 1

    def info(self) -> TableInfo:
        """A consistent snapshot of sizes, counters and sampler figures."""
        with self._lock:
            return TableInfo(
                name=self.name,
                sampler=self.config.sampler.value,
                capacity=self._ring.capacity,
                size=self.size,
                schema=None if self._schema is None else self._schema.describe(),
                pinned=self._storage is not None and self._storage.pinned,
                storage_bytes=0 if self._storage is None else self._storage.nbytes,
                counters=TableCounters(**asdict(self._counters)),
                sampler_stats=self._sampler.stats(),
                config=self.config.describe(),
                rate_limiter=self._limiter.info(),
            )

    # ------------------------------------------------------------ persistence

    _instant_bytes = 0  # what the last snapshot's instant copied: the next one's Arena size

    def snapshot(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TableSnapshot:
        """Begin a consistent snapshot of the table as it is now (:mod:`replay_server.snapshot`).

        Copies everything but the rows under the lock (O(slots used) of small
        per-slot sampler arrays, into memory touched before the lock); the rows
        are read out afterwards in pieces of ``chunk_bytes``, under short lock
        holds. Close the snapshot when done.
        """
        # The first time, a bound: no sampler keeps more than 16 bytes per slot.
        arena = Arena(self._instant_bytes or 16 * min(self._ring.next_id, self._ring.capacity))
        with self._lock, arena.active():
            used = min(self._ring.next_id, self._ring.capacity)
            state = {
                "version": STATE_VERSION,
                "config": self.config.describe(),
                "schema": None if self._schema is None else self._schema.state_dict(),
                "ring": self._ring.state_dict(),
                "columns": {},  # the rows: read from the snapshot's ``rows``
                "sampler": self._sampler.state_dict(),
                "counters": asdict(self._counters),
                "generator": generator_state(self._generator),
                "rate_limiter": self._limiter.state_dict(),
                "times_sampled": self._retirement.state_dict(used) if self._retirement else None,
            }
            rows = None if self._storage is None else self._storage.snapshot(
                self._lock, self._ring.next_id % self._ring.capacity, used, chunk_bytes)
        self._instant_bytes = arena.wanted
        return TableSnapshot(state, rows)

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

        The state is loaded into a fresh table first and swapped in only once
        it has loaded completely, so a malformed state changes nothing (the
        cost: twice the table's memory while loading). ``read_rows``, if
        given, fills the rows instead of ``state["columns"]``: it is called
        with numpy views of the fresh table's whole columns (bfloat16 as
        int16), e.g. to read them from files; what it raises propagates as is.

        Raises:
            ConfigError: the state has another layout version, contradicts this
                table's config (capacity, sampler, slice_len, alpha, keys) or
                schema (the message names both values).
            MalformedStateError: the state is malformed.
        """
        fresh = Table(self.config)
        try:
            fresh._load(state, self._schema, read_rows is None)
        except ConfigError:
            raise
        except Exception as exc:
            raise MalformedStateError(
                f"table {self.name!r}: saved state is malformed ({type(exc).__name__}: {exc})"
            ) from exc
        if read_rows is not None and fresh._storage is not None:
            read_rows(fresh._storage.views)
        with self._lock:
            self._ring, self._sampler = fresh._ring, fresh._sampler
            self._storage, self._schema = fresh._storage, fresh._schema
            self._counters, self._generator = fresh._counters, fresh._generator
            self._limiter, self._retirement = fresh._limiter, fresh._retirement

    def _load(self, state: Mapping[str, Any], schema_now: Schema | None, columns: bool) -> None:
        """Load ``state`` (its rows too if ``columns``) into this fresh table; may fail half-way."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ConfigError(
                f"table {self.name!r}: saved state has layout version {version!r}, this "
                f"server reads version {STATE_VERSION}"
            )
        mine = self.config.describe()
        for key in ("capacity", "sampler", "slice_len", "alpha", "episode_key", "done_key",
                    "truncated_key"):
            if state["config"][key] != mine[key]:
                raise ConfigError(
                    f"table {self.name!r}: config says {key}={mine[key]!r} but the saved "
                    f"state has {key}={state['config'][key]!r}"
                )
        schema = None if state["schema"] is None else Schema.from_state_dict(state["schema"])
        if schema_now is not None and schema is not None and dict(schema) != dict(schema_now):
            raise ConfigError(
                f"table {self.name!r}: the table's schema is {schema_now.describe()} but the "
                f"saved state has {schema.describe()}"
            )
        if schema is not None and self._storage is None:
            self._allocate(schema)
        self._ring.load_state_dict(state["ring"])
        if self._storage is not None and columns:
            used = min(self._ring.next_id, self._ring.capacity)
            for key, column in state["columns"].items():
                if key not in self._storage.columns or column.shape[0] != used:
                    raise MalformedStateError(
                        f"table {self.name!r}: saved column {key!r} does not fit the schema "
                        f"and {used} stored slots"
                    )
            self._storage.load_state_dict(state["columns"])
        self._sampler.load_state_dict(state["sampler"])
        load_retirement(self._retirement, state.get("times_sampled"), self._ring, self.name)
        self._limiter.load_state_dict(state.get("rate_limiter"), size=self.size)
        self._counters = TableCounters(**state["counters"])
        self._generator.bit_generator.state = generator_from_state(state["generator"])


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (one that requires grad is detached first)."""
    return tensor.detach().numpy()
