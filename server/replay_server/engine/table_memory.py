"""A table's memory: what each of its layers declares, added up, and promised to a ledger.

A table is promised its sampler's, remover's and readers' per-slot state at
capacity when it is made (and its rows' memory too where the config declares
the schema); the rows' memory when the first insert fixes the schema; and a
compressed table's blocks as they are stored (:func:`memory_promise`).
:func:`table_bytes` is the sum (:mod:`replay_server.engine.memory` says why
it is promised before anything is allocated); :class:`TableMemory` makes one
table's promises, each with a message naming what it is for.

Every size comes from the layers' declarations (:mod:`replay_server.engine.slot_memory`,
:mod:`replay_server.engine.sampler_kinds`, :mod:`replay_server.engine.storage_kinds`), so
``check-config`` promises the same bytes without loading torch.

Thread-safety: the ledger is thread-safe; the functions are pure.
"""

from __future__ import annotations

from collections.abc import Callable

from replay_server.engine.config import TableConfig
from replay_server.engine.memory import MemoryLedger, format_bytes
from replay_server.engine.reader_options import storage_schema
from replay_server.engine.sampler_kinds import SAMPLERS
from replay_server.engine.schema import Schema
from replay_server.engine.slot_memory import (
    FRAMESTACK_SLOT_BYTES,
    NSTEP_SLOT_BYTES,
    remover_slot_bytes,
)
from replay_server.engine.storage_kinds import BACKENDS, column_ram_bytes


class TableMemory:
    """One table's promises to a memory ledger.

    Args:
        config: the table's config.
        ledger: the ledger the table's memory is promised from (a server's tables share one).

    Each ``promise_*`` replaces the table's promise by a new total.

    Raises (every ``promise_*``):
        InsufficientMemoryError: the total would pass the ledger's limit; naming the table.
    """

    def __init__(self, config: TableConfig, ledger: MemoryLedger) -> None:
        self.config = config
        self.ledger = ledger

    def promise_state(self, declared: Schema | None = None) -> None:
        """The table's per-slot state at capacity, and the rows of a ``declared`` schema."""
        config = self.config
        self.ledger.require(config.name, table_bytes(config, declared),
                            f"capacity {config.capacity:,} (sampler state"
                            f"{'' if declared is None else ' and the declared schema'})")

    def promise_rows(self, schema: Schema, what: str = "") -> None:
        """The table's per-slot state and its rows of ``schema`` at capacity (``what``: the
        schema's origin, for the message)."""
        config = self.config
        self.ledger.require(config.name, table_bytes(config, schema),
                            f"capacity {config.capacity:,} x {schema.row_bytes:,} bytes per row "
                            f"({what}{schema.describe()})")

    def growth(self, schema: Schema) -> Callable[[int], None] | None:
        """What promises the compressed rows of ``schema`` as storage takes them."""
        return memory_promise(self.config, self.ledger)(schema)


def sampler_slot_bytes(config: TableConfig) -> int:
    """Bytes of per-slot state a table of ``config`` allocates: its sampler's, its remover's
    and its readers' (each as the layer declares it)."""
    limit = config.removal_limit
    per_slot = SAMPLERS[config.sampler.value].slot_bytes(config.sampler_options, config.capacity,
                                                         deletes=limit > 0)
    per_slot += NSTEP_SLOT_BYTES if config.n_step > 1 else 0
    per_slot += FRAMESTACK_SLOT_BYTES if config.frame_stack_key else 0
    return per_slot + (remover_slot_bytes(limit) if limit else 0)


def stored_schema(config: TableConfig, schema: Schema) -> Schema:
    """What the storage of a table of ``config`` keeps for rows of ``schema``."""
    if config.frame_stack_key is None:
        return schema
    return storage_schema(schema, config.frame_stack_key)


def storage_ram_bytes(config: TableConfig, schema: Schema) -> int:
    """Bytes of RAM the columns of ``schema`` (as stored) are promised at the table's capacity,
    each as its backend declares it (compressed rows are promised as they are stored)."""
    compressed = set(config.compress_keys or ())
    return sum(column_ram_bytes(BACKENDS[config.backend_of(key)], key in compressed, spec,
                                config.capacity, on_device=config.on_device)
               for key, spec in schema.items())


def table_bytes(config: TableConfig, schema: Schema | None) -> int:
    """Bytes of RAM a table of ``config`` is promised at its capacity (rows of ``schema``,
    if fixed): each layer's declaration. ``memmap`` and device columns count none (their
    disk and device memory are checked when allocated), compressed columns their
    per-slot offsets (their blocks are promised as they are stored)."""
    rows = 0 if schema is None else storage_ram_bytes(config, stored_schema(config, schema))
    return rows + config.capacity * sampler_slot_bytes(config)


def memory_promise(config: TableConfig, memory: MemoryLedger | None
                   ) -> Callable[[Schema], Callable[[int], None] | None]:
    """For a schema, what promises a table's compressed rows as their storage takes memory:
    the table's :func:`table_bytes` plus the bytes taken, promised to ``memory`` (which
    raises to refuse the insert that needs them)."""
    def for_schema(schema: Schema) -> Callable[[int], None] | None:
        if memory is None:
            return None
        base = table_bytes(config, schema)

        def grow(nbytes: int) -> None:
            memory.require(config.name, base + nbytes,
                           f"capacity {config.capacity:,} of {schema.describe()} with "
                           f"{format_bytes(nbytes)} of compressed rows")
        return grow
    return for_schema
