"""Everything a table mutates, held together so that a load can replace it whole; and the
one place that wires the layers a config names (sampler, remover, storage, readers) and
adds up their declared memory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_server.engine.config import StorageKind, TableConfig
from replay_server.engine.id_space import IdSpace, IncarnationSource, LocalIncarnations
from replay_server.engine.ids import IdRing
from replay_server.engine.inputs import check_sampler_columns
from replay_server.engine.nstep import NStepIndex
from replay_server.engine.rate_limiter import RateLimiter
from replay_server.engine.remover import Remover
from replay_server.engine.samplers import SAMPLERS, Sampler
from replay_server.engine.schema import Schema
from replay_server.engine.storage import (
    ColumnStorage,
    check_storage,
    make_storage,
    stored_row_bytes,
)
from replay_server.engine.storage.framestack import FrameStacks, storage_schema
from replay_server.engine.table_info import TableCounters
from replay_server.errors import ConfigError, InsufficientMemoryError, SchemaMismatchError


@dataclass(slots=True)
class TableParts:
    """The id ring and id space, sampler, storage, counters, generator, limiter, remover,
    n-step index and frame stacks of one table.

    Owned by one :class:`~replay_server.engine.table.Table` and guarded by its
    lock. A restore builds a new set (:func:`fresh`, then loads it) and the
    table swaps it in with one assignment, so a failed load changes nothing.
    """

    ring: IdRing
    ids: IdSpace
    sampler: Sampler
    generator: np.random.Generator
    counters: TableCounters
    limiter: RateLimiter
    remover: Remover | None
    nstep: NStepIndex | None = None
    frames: FrameStacks | None = None
    schema: Schema | None = None
    storage: ColumnStorage | None = None

    @property
    def size(self) -> int:
        """Rows present (retired rows excluded: a queue's rows taken)."""
        return self.ring.size - (self.remover.retired if self.remover else 0)

    @property
    def used(self) -> int:
        """Slots ever written."""
        return min(self.ring.next_id, self.ring.capacity)

    def allocate(self, schema: Schema, config: TableConfig) -> None:
        """Fix the schema and allocate the storage ``config`` names for the table's capacity."""
        key = config.frame_stack_key
        if key is None:
            self.storage = make_storage(config, schema)
        else:
            self.storage = make_storage(config, storage_schema(schema, key))
            self.frames = FrameStacks(self.ring, key, schema[key].shape[0],
                                      config.frame_stack_fill)
        self.schema = schema


def fresh_parts(config: TableConfig, incarnations: IncarnationSource | None = None) -> TableParts:
    """An empty table's parts; storage allocated now if the config declares a schema.

    ``incarnations``: where its id segments get their incarnation (``None``:
    an in-process table's, shard 0 and incarnation 0).

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
        sampler = SAMPLERS[config.sampler.value].build(ring, config, deletes=limit > 0)
        remover = Remover(ring, limit) if limit else None
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
        nstep=None if config.n_step == 1 else NStepIndex(
            ring, config.n_step, config.gamma, config.reward_key, config.done_key,
            config.truncated_key),
    )
    if config.schema is not None:
        schema = Schema(config.schema)
        try:
            check_sampler_columns(config, schema)
        except SchemaMismatchError as exc:
            raise ConfigError(str(exc)) from None
        parts.allocate(schema, config)
    return parts


def sampler_slot_bytes(config: TableConfig) -> int:
    """Bytes of per-slot state a table of ``config`` allocates when it is made: its
    sampler's, its remover's and its readers' (each as the layer declares it)."""
    limit = config.removal_limit
    per_slot = SAMPLERS[config.sampler.value].slot_bytes(config, deletes=limit > 0)
    per_slot += NStepIndex.SLOT_BYTES if config.n_step > 1 else 0
    per_slot += FrameStacks.SLOT_BYTES if config.frame_stack_key else 0
    return per_slot + (Remover.slot_bytes(limit) if limit else 0)


def table_bytes(config: TableConfig, schema: Schema | None) -> int:
    """Bytes of RAM a table of ``config`` needs at its capacity (rows of ``schema``, if fixed).

    A ``memmap`` table's rows live in files (the page cache holds what fits),
    so only its per-slot state counts; its disk is checked when its files are
    reserved (:mod:`~replay_server.engine.storage.memmap`). A device table's
    rows live in device memory, checked against the device when they are
    allocated (:mod:`~replay_server.engine.storage.placement`).
    """
    row = 0 if (schema is None or config.storage is StorageKind.MEMMAP
                or config.on_device) else stored_row_bytes(config, schema)
    return config.capacity * (row + sampler_slot_bytes(config))
