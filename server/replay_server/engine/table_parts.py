"""Everything a table mutates, held together so that a load can replace it whole; and the
one place that wires the layers a config names (sampler, remover, storage, readers).

The layers never import one another (``tests/test_layout.py``): a sampler
sees positions, the remover counts draws and asks the sampler to stop
drawing rows, the storage keeps columns, and the readers shape positions
into batch columns through the storage. This module builds them from a
:class:`~replay_server.engine.config.TableConfig` and a schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.id_space import IdSpace
from replay_server.engine.incarnations import IncarnationSource, LocalIncarnations
from replay_server.engine.ids import IdRing
from replay_server.engine.inputs import check_sampler_columns
from replay_server.engine.leases import Lease, Leases
from replay_server.engine.rate_limiter import RateLimiter
from replay_server.engine.readers import FrameStacks, NStepReturns, Reader, StoredRows
from replay_server.engine.remover import Remover
from replay_server.engine.samplers import SAMPLERS, Sampler
from replay_server.engine.schema import Schema
from replay_server.engine.storage import (
    ColumnStorage,
    check_storage,
    make_storage,
)
from replay_server.engine.table_info import TableCounters, TableInfo, field_values
from replay_server.errors import ConfigError, InsufficientMemoryError, SchemaMismatchError


@dataclass(slots=True)
class TableParts:
    """The id ring and id space, sampler, remover, storage, readers, counters, generator and
    rate limiter of one table.

    Owned by one :class:`~replay_server.engine.table.Table` and guarded by its
    lock. A restore builds a new set (:func:`fresh_parts`, then loads it) and the
    table swaps it in with one assignment, so a failed load changes nothing.

    Attributes:
        readers: bottom (the stored rows) to top (what a sample reads).
    """

    ring: IdRing
    ids: IdSpace
    sampler: Sampler
    generator: np.random.Generator
    counters: TableCounters
    limiter: RateLimiter
    remover: Remover | None
    readers: list[Reader] = field(default_factory=list)
    leases: Leases = field(default_factory=Leases)
    schema: Schema | None = None
    storage: ColumnStorage | None = None

    @property
    def size(self) -> int:
        """Rows present (retired rows excluded: a queue's rows taken)."""
        return self.ring.size - (self.remover.rows_gone if self.remover else 0)

    @property
    def used(self) -> int:
        """Slots written since the last reset (:attr:`IdRing.used`)."""
        return self.ring.used

    @property
    def drawn_from(self) -> ColumnStorage:
        """The storage a draw reads from (a draw found rows, so the first insert made it)."""
        assert self.storage is not None, "no storage before the first insert"
        return self.storage

    @property
    def top(self) -> Reader:
        """The reader a sample reads through."""
        return self.readers[-1]

    def row_reader(self, config: TableConfig) -> Reader:
        """The reader that gives rows as they were inserted (TorchRL's ``rb[i]``): the stored
        rows, their frame stacks rebuilt where ``config`` stacks frames; never the n-step
        reader above, which reads transitions (the order :meth:`allocate` stacks them in)."""
        return self.readers[1 if config.frame_stack_key is not None else 0]

    def info(self, config: TableConfig) -> TableInfo:
        """Sizes, counters and figures of each layer, and the capabilities they declare
        (call under the table's lock)."""
        storage = self.storage
        return TableInfo(
            name=config.name,
            sampler=config.sampler.value,
            capacity=self.ring.capacity,
            size=self.size,
            schema=None if self.schema is None else self.schema.describe(),
            pinned=storage is not None and storage.pinned,
            storage_bytes=0 if storage is None else storage.nbytes,
            pinned_bytes=0 if storage is None else storage.pinned_bytes,
            counters=TableCounters(**field_values(self.counters)),
            sampler_stats={**self.sampler.stats(),
                           **{k: v for reader in self.readers for k, v in reader.stats().items()},
                           **(storage.stats() if storage else {})},
            config=config.describe(),
            rate_limiter=self.limiter.info(),
            mass=self.sampler.mass(),
            capabilities=replace(
                self.sampler.traits,
                retires=config.max_times_sampled > 0,
                n_step=config.n_step,
                frame_stack_key=config.frame_stack_key or "",
                partial_slices=not config.strict_length,
                span_left=config.span_left,
                span_right=config.span_right),
            id_segments=self.live_segments(),
        )

    def live_segments(self) -> tuple[tuple[int, int], ...]:
        """``(incarnation, first_position)`` of the id segments that hold stored rows (the
        current one always), oldest first: what a client turns ids into storage positions
        with (``TableInfo.id_segments``)."""
        first_live = self.ring.first_live
        return tuple((incarnation, first) for incarnation, first, end in self.ids.segments
                     if end is None or end > first_live)

    def stored(self, columns: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """An insert's columns as the readers have them stored (a frame stack keeps its
        newest frame)."""
        for reader in self.readers:
            columns = reader.stored(columns)
        return columns

    def give_back(self, lease: Lease, *, count: bool = True) -> int:
        """Return ``lease``'s rows still stored to the queue, in their place in its order;
        how many came back.

        The rate limiter counts them as neither sampled nor deleted; with
        ``count``, the ``returned`` counter grows by them. O(rows).
        """
        remover = self.remover
        assert remover is not None, "leases are taken from tables whose rows leave when sampled"
        back = sum(remover.give_back(self.sampler, removal) for removal in reversed(lease.removals))
        self.limiter.deleted(-back)
        self.limiter.sampled(-back)
        if count:
            self.counters.returned += back
        return back

    def retake(self, lease: Lease) -> None:
        """Take ``lease``'s rows out of the queue again after :meth:`give_back` (``count=False``)."""
        remover = self.remover
        assert remover is not None
        positions = np.concatenate([removal.positions for removal in lease.removals]) \
            if lease.removals else np.empty(0, dtype=np.int64)
        positions = positions[self.ring.live(positions)] if positions.size else positions
        again = remover.delete(self.sampler, np.sort(positions))
        self.limiter.deleted(again)
        self.limiter.sampled(again)

    def settle_leases(self, acknowledge: Iterable[str] = (),
                      give_back: Iterable[str] = (),
                      acknowledge_first: tuple[str, int] | None = None) -> int:
        """Acknowledge leases (``acknowledge_first``: the first draws of one), give others
        back, and return the rows of those expired now; the rows that came back. O(1) when
        the table holds no lease."""
        leases = self.leases
        if not len(leases):
            return 0
        leases.acknowledge(acknowledge)
        if acknowledge_first is not None:
            leases.acknowledge_first(*acknowledge_first)
        taken = leases.take_back(give_back) + leases.due()
        return sum(self.give_back(lease) for lease in taken)

    @contextmanager
    def leases_given_back(self) -> Iterator[None]:
        """For the block, the queue as if every lease had been given back; then held again.

        What a checkpoint saves (under the table's lock): rows not acknowledged
        are in the queue, so a restore hands them out again.
        """
        leases = self.leases.all()
        for lease in leases:
            self.give_back(lease, count=False)
        try:
            yield
        finally:
            for lease in reversed(leases):
                self.retake(lease)

    def encode_early(self, columns: Mapping[str, torch.Tensor], table: str
                     ) -> tuple[ColumnStorage, Schema, dict[str, Any]] | None:
        """The insert's rows as the storage keeps them (compressed, frames reduced), made
        before the table's lock when the schema is fixed and they match it; with the
        storage they were made for and the schema they were checked against (a load or a
        reset may replace both before the lock is taken). Reads only what a load replaces
        whole, so it needs no lock."""
        storage, schema = self.storage, self.schema
        if storage is None or schema is None:
            return None
        try:
            schema.check(columns, table)
        except SchemaMismatchError:
            return None  # refused under the lock, with the same message
        return storage, schema, storage.encode(self.stored(columns))

    def allocate(self, schema: Schema, config: TableConfig,
                 grow: Callable[[int], None] | None = None,
                 reuse: ColumnStorage | None = None) -> None:
        """Fix the schema, stack the readers ``config`` names and allocate the storage for
        the rows as they store them. ``grow``: see :func:`make_storage`. ``reuse``: an
        empty table's storage, taken instead of a new one where it has that very layout
        (a restore then needs no second copy: for a ``memmap`` table, no second file)."""
        bottom = StoredRows(self.ring)
        readers: list[Reader] = [bottom]
        if config.frame_stack_key is not None:
            readers.append(FrameStacks(self.ring, readers[-1], config.frame_stack_key, schema,
                                       config.frame_stack_fill))
        if config.n_step > 1:
            readers.append(NStepReturns(self.ring, readers[-1], schema, config.n_step,
                                        config.gamma, config.reward_key, config.done_key,
                                        config.truncated_key))
        stored = schema
        for reader in readers:
            stored = reader.stored_schema(stored)
        if (reuse is not None and reuse.capacity == config.capacity
                and dict(reuse.schema) == dict(stored)):
            self.storage = reuse
        else:
            self.storage = make_storage(config, stored, grow)
        bottom.attach(self.storage)
        self.readers = readers
        self.schema = schema

    def clear(self) -> None:
        """Every layer emptied (a reset): rows, leases, sampler, rate limiter, remover and
        readers; ids keep counting. Counted in ``resets``."""
        self.ring.clear()
        self.leases.clear()
        self.sampler.clear()
        self.limiter.reset()
        if self.remover is not None:
            self.remover.clear()
        for reader in self.readers:
            reader.clear()
        self.counters.resets += 1

    def forget_schema(self) -> None:
        """Drop the schema, its storage and the readers built for it: the next insert fixes
        a new one.

        Only for an empty table (after its rows were cleared); the storage's
        memory is freed once nothing else holds it.
        """
        self.schema = None
        self.storage = None
        self.readers = [StoredRows(self.ring)]


def schema_way_out(config: TableConfig) -> str:
    """What the sender of an insert the schema refused can do, for its error message."""
    if config.schema is not None:
        return ("the schema is declared in the config (tables.schema): send rows that match "
                "it, or change the config and restart")
    return (f"send rows that match it, or reset the table with its schema so that the next "
            f"insert fixes a new one (its rows are dropped): "
            f"client.reset({config.name!r}, schema=True) or "
            f"`replay-server reset {config.name} --schema`")


def fresh_parts(config: TableConfig, incarnations: IncarnationSource | None = None,
                grow: Callable[[Schema], Callable[[int], None] | None] | None = None,
                reuse: ColumnStorage | None = None) -> TableParts:
    """An empty table's parts; storage allocated now if the config declares a schema.

    ``incarnations``: where its id segments get their incarnation (``None``:
    an in-process table's, shard 0 and incarnation 0). ``grow``: the promise
    of compressed rows' memory for a schema (see :func:`make_storage`).
    ``reuse``: see :meth:`TableParts.allocate`.

    Raises:
        ConfigError: the declared schema cannot serve the sampler or readers, pinned
            memory was requested without an accelerator, or a ``memmap``
            table's ``storage_dir`` is missing or not writable.
        InsufficientMemoryError: an allocation failed (or the disk cannot hold the table).
    """
    check_storage(config)
    ring = IdRing(config.capacity)
    ids = IdSpace(incarnations or LocalIncarnations())
    ids.begin(0)
    limit = config.removal_limit
    try:
        sampler = SAMPLERS[config.sampler.value].build(ring, config.sampler_options,
                                                       deletes=limit > 0)
        remover = (Remover(ring, limit, removes_rows=not config.sampler.traits.slices)
                   if limit else None)
    except MemoryError:
        raise InsufficientMemoryError(
            f"table {config.name!r}: cannot allocate the {config.sampler.value} sampler's "
            f"state for capacity {config.capacity:,}") from None
    parts = TableParts(
        ring=ring,
        ids=ids,
        sampler=sampler,
        # numpy's PCG64: single-threaded draws, and a state of plain integers to save.
        generator=np.random.Generator(np.random.PCG64(config.seed)),
        counters=TableCounters(),
        limiter=RateLimiter.from_config(config),
        remover=remover,
        readers=[StoredRows(ring)],
    )
    if config.schema is not None:
        schema = Schema(config.schema)
        try:
            check_sampler_columns(config, schema)
        except SchemaMismatchError as exc:
            raise ConfigError(str(exc)) from None
        parts.allocate(schema, config, None if grow is None else grow(schema), reuse)
    return parts
