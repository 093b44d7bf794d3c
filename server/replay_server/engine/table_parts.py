"""Everything a table mutates, held together so that a load can replace it whole."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_server.engine.config import TableConfig
from replay_server.engine.id_space import IdSpace, IncarnationSource, LocalIncarnations
from replay_server.engine.ids import IdRing
from replay_server.engine.inputs import check_sampler_columns
from replay_server.engine.nstep import NStepIndex
from replay_server.engine.rate_limiter import RateLimiter
from replay_server.engine.retirement import Retirement
from replay_server.engine.samplers import QueueSampler, Sampler, make_sampler
from replay_server.engine.schema import Schema
from replay_server.engine.storage import ColumnStorage, check_storage, make_storage
from replay_server.engine.storage.framestack import FrameStacks, storage_schema
from replay_server.engine.table_info import TableCounters
from replay_server.errors import ConfigError, InsufficientMemoryError, SchemaMismatchError


@dataclass(slots=True)
class TableParts:
    """The id ring and id space, sampler, storage, counters, generator, limiter, retirement,
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
    retirement: Retirement | None
    nstep: NStepIndex | None = None
    frames: FrameStacks | None = None
    schema: Schema | None = None
    storage: ColumnStorage | None = None

    @property
    def size(self) -> int:
        """Rows present (retired rows excluded; a queue's rows not yet taken)."""
        queue = self.queue
        if queue is not None:
            return queue.depth
        return self.ring.size - (self.retirement.retired if self.retirement else 0)

    @property
    def queue(self) -> QueueSampler | None:
        """The sampler, when it is a consume-once queue (``fifo``/``lifo``)."""
        sampler = self.sampler
        return sampler if isinstance(sampler, QueueSampler) else None

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

    def forget_schema(self) -> None:
        """Drop the schema and its storage (and frame stacks): the next insert fixes a new one.

        Only for an empty table (after its rows were cleared); the storage's
        memory is freed once nothing else holds it.
        """
        self.schema = None
        self.storage = None
        self.frames = None


def schema_way_out(config: TableConfig) -> str:
    """What the sender of an insert the schema refused can do, for its error message."""
    if config.schema is not None:
        return ("the schema is declared in the config (tables.schema): send rows that match "
                "it, or change the config and restart")
    return (f"send rows that match it, or reset the table with its schema so that the next "
            f"insert fixes a new one (its rows are dropped): "
            f"client.reset({config.name!r}, schema=True) or "
            f"`replay-server reset {config.name} --schema`")


def fresh_parts(config: TableConfig, incarnations: IncarnationSource | None = None) -> TableParts:
    """An empty table's parts; storage allocated now if the config declares a schema.

    ``incarnations``: where its id segments get their incarnation (``None``:
    an in-process table's, shard 0 and incarnation 0).

    Raises:
        ConfigError: the declared schema cannot serve the sampler, pinned
            memory was requested without an accelerator, or a ``memmap``
            table's ``storage_dir`` is missing or not writable.
        InsufficientMemoryError: an allocation failed (or the disk cannot hold the table).
    """
    check_storage(config)
    ring = IdRing(config.capacity)
    ids = IdSpace(incarnations or LocalIncarnations())
    ids.begin(0)
    try:
        sampler = make_sampler(config, ring)
        retirement = (Retirement(config.capacity, config.max_times_sampled)
                      if config.max_times_sampled else None)
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
        retirement=retirement,
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
