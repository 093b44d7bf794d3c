"""A table: a fixed-capacity FIFO ring of rows, stored column-wise, with one sampler.

Rows go in through :meth:`Table.insert` (leading dim = rows) and get int64 ids
(see :mod:`replay_server.ids`); samples come out as
:class:`~replay_proto.batch.SampleBatch`; priorities are updated by id. The
table is the only orchestrator: under its lock it validates, writes storage
and tells its sampler exactly once.

Every method either succeeds or raises a
:class:`~replay_server.errors.ReplayServerError` having changed nothing.

Thread-safety: all public methods may be called from any thread; one lock per
table serializes them (tables do not block each other). Tensor conversion of
inputs happens before the lock is taken, the copies in and out under it.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_proto.dtypes import DTYPES
from replay_proto.keys import flatten, unflatten
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
from replay_server.rng import generator_from_state, generator_state
from replay_server.samplers import InsertEvent, make_sampler
from replay_server.schema import FieldSpec, Schema
from replay_server.snapshot import DEFAULT_CHUNK_BYTES, Arena, TableSnapshot
from replay_server.storage import ColumnStorage

STATE_VERSION = 1
"""Version of :meth:`Table.state_dict`'s layout; bumped on any incompatible change."""

MAX_BATCH_SIZE = 1 << 24
"""Largest ``batch_size`` a single sample may ask for."""

_STORABLE = frozenset(DTYPES.values())
_LOG_FLOAT32_MAX = math.log(float(torch.finfo(torch.float32).max))
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(slots=True)
class TableCounters:
    """Monotonic counts since the table was created (kept across reset and restore)."""

    inserted: int = 0
    evicted: int = 0
    sample_calls: int = 0
    sampled: int = 0
    priority_updates: int = 0
    stale_priority_updates: int = 0
    resets: int = 0


@dataclass(frozen=True, slots=True)
class TableInfo:
    """A snapshot of one table, for ``info``."""

    name: str
    sampler: str
    capacity: int
    size: int
    schema: dict[str, str] | None
    pinned: bool
    storage_bytes: int
    counters: TableCounters
    sampler_stats: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


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
        """Rows present."""
        return self._ring.size

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

        Cost: one copy of the rows into storage plus the sampler's insert
        (O(rows * log capacity) at worst).
        """
        columns = self._columns(data)
        rows = self._row_count(columns)
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
            if self._storage is None:
                self._allocate(schema)
            assert self._storage is not None
            event = self._insert_event(columns, rows, checked_priorities)
            evicted_first_id = self._ring.first_live
            first_id, evicted = self._ring.allocate(rows)
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
        return torch.from_numpy(self._ring.range(first_id, rows))

    def _columns(self, data: Any) -> dict[str, torch.Tensor]:
        try:
            flat = flatten(data)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"table {self.name!r}: {exc}") from None
        if not flat:
            raise InvalidArgumentError(f"table {self.name!r}: insert has no columns")
        columns = {}
        for key, value in flat.items():
            columns[key] = self._as_tensor(value, f"key {key!r}")
            if columns[key].dtype not in _STORABLE:
                raise SchemaMismatchError(
                    f"table {self.name!r}: key {key!r} has dtype {columns[key].dtype}, which a "
                    f"table cannot store; supported dtypes: {', '.join(DTYPES)}"
                )
            if columns[key].dim() == 0:
                raise InvalidArgumentError(
                    f"table {self.name!r}: key {key!r} is a scalar; every column needs a "
                    f"leading dimension of rows (use shape [1] for one row)"
                )
        return columns

    def _as_tensor(self, value: Any, what: str) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value if value.device.type == "cpu" else value.cpu()
        try:
            array = np.asarray(value)
            if any(stride < 0 for stride in array.strides):  # torch refuses reversed views
                array = array.copy()
            return torch.as_tensor(array)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(
                f"table {self.name!r}: {what} is not a tensor or array "
                f"({type(value).__name__}): {exc}"
            ) from None

    def _row_count(self, columns: Mapping[str, torch.Tensor]) -> int:
        counts = {key: int(col.shape[0]) for key, col in columns.items()}
        if len(set(counts.values())) > 1:
            raise InvalidArgumentError(
                f"table {self.name!r}: columns have different numbers of rows "
                f"(leading dims): {counts}"
            )
        return next(iter(counts.values()))

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
            tensor = self._as_tensor(priorities, "priorities")
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

    def sample(self, batch_size: int) -> SampleBatch:
        """Draw ``batch_size`` rows (or slices) with replacement, per the table's sampler.

        Raises:
            InvalidArgumentError: ``batch_size`` is not an integer in [1, MAX_BATCH_SIZE].
            EmptyTableError: nothing can be sampled yet.

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
        with self._lock:
            try:
                index = self._sampler.sample(batch_size, self._generator)
            except EmptyTableError as exc:
                raise EmptyTableError(f"table {self.name!r}: {exc}") from None
            assert self._storage is not None
            data = self._storage.gather(index.slots)
            self._counters.sample_calls += 1
            self._counters.sampled += batch_size
        return SampleBatch(
            unflatten(data),
            torch.from_numpy(index.ids),
            torch.from_numpy(index.weights),
            torch.from_numpy(index.probabilities),
        )

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
            id_tensor = self._as_tensor(ids, "ids")
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
            self._counters.resets += 1

    def info(self) -> TableInfo:
        """A consistent snapshot of sizes, counters and sampler figures."""
        with self._lock:
            return TableInfo(
                name=self.name,
                sampler=self.config.sampler.value,
                capacity=self._ring.capacity,
                size=self._ring.size,
                schema=None if self._schema is None else self._schema.describe(),
                pinned=self._storage is not None and self._storage.pinned,
                storage_bytes=0 if self._storage is None else self._storage.nbytes,
                counters=TableCounters(**asdict(self._counters)),
                sampler_stats=self._sampler.stats(),
                config=self.config.describe(),
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
        self._counters = TableCounters(**state["counters"])
        self._generator.bit_generator.state = generator_from_state(state["generator"])


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (one that requires grad is detached first)."""
    return tensor.detach().numpy()
