"""A table's state as tensors and plain values: the snapshot side and the load side.

:func:`snapshot_parts` copies everything but the rows at one instant, under
the table's lock, and starts a row snapshot that reads the rows afterwards
in pieces (see :mod:`replay_server.engine.snapshot`). :func:`load_parts`
builds a fresh :class:`~replay_server.engine.table_parts.TableParts` from a
saved state, refusing one that contradicts the table's config. Nothing here
pickles or runs code on load: a state is loadable with
``torch.load(..., weights_only=True)``.

Layout (``STATE_VERSION``): ``version``, ``config`` (plain values),
``schema``, ``ring`` (position counters), ``ids`` (shard and id segments:
:mod:`~replay_server.engine.id_space`; absent in states saved before ids
had segments, whose ids were positions), ``columns`` (the slots ever written, in
slot order; empty in a snapshot, whose rows are read from ``rows``),
``sampler``, ``counters``, ``generator``, ``rate_limiter``, ``times_sampled`` (the remover's
draw counts; a queue table saved before queues had a remover has none, and its counts are
made from the queue's runs: the live rows outside them were taken), ``nstep``
(next-step links of an n-step table; absent or ``None`` otherwise), ``frames`` (links and
kept histories of a frame-stacked table; likewise).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.incarnations import IncarnationSource
from replay_server.engine.memory import MemoryLedger
from replay_server.engine.remover import load_remover
from replay_server.engine.rng import generator_from_state, generator_state
from replay_server.engine.schema import Schema
from replay_server.engine.snapshot import Arena, TableSnapshot
from replay_server.engine.storage import ColumnStorage
from replay_server.engine.table_info import TableCounters
from replay_server.engine.table_memory import memory_promise, table_bytes
from replay_server.engine.table_parts import TableParts, fresh_parts
from replay_server.errors import ConfigError, InsufficientMemoryError, MalformedStateError

STATE_VERSION = 1
"""Version of a table state's layout; bumped on any incompatible change."""

_MUST_MATCH = ("capacity", "sampler", "slice_len", "alpha", "episode_key", "done_key",
               "truncated_key")
"""Config fields a saved state must agree with (the rest may change between runs)."""

_SLICE_SHAPE = {"strict_length": True, "span_left": 0, "span_right": 0}
"""Config fields that decide which slice starts a saved sampler holds, with the value a
state saved before they existed has."""


def snapshot_parts(config: TableConfig, parts: TableParts, lock: threading.Lock,
                   arena_bytes: int, chunk_bytes: int) -> tuple[TableSnapshot, int]:
    """Begin a consistent snapshot of ``parts`` as they are now.

    Takes ``lock`` once, to copy everything but the rows into memory touched
    before it (an :class:`~replay_server.engine.snapshot.Arena` of
    ``arena_bytes``; 0: a bound of 16 bytes per used slot); rows are read
    later. Returns the snapshot and the arena size the next one should use.
    """
    arena = Arena(arena_bytes or 16 * parts.used)
    # Leased rows are saved in the queue: a lease not acknowledged is handed out again.
    with lock, arena.active(), parts.leases_given_back():
        used = parts.used
        state = {
            "version": STATE_VERSION,
            "config": config.describe(),
            "schema": None if parts.schema is None else parts.schema.state_dict(),
            "ring": parts.ring.state_dict(),
            "ids": parts.ids.state_dict(),
            "columns": {},  # the rows: read from the snapshot's ``rows``
            "sampler": parts.sampler.state_dict(),
            "counters": asdict(parts.counters),
            "generator": generator_state(parts.generator),
            "rate_limiter": parts.limiter.state_dict(),
            "times_sampled": parts.remover.state_dict(used) if parts.remover else None,
            "nstep": None,  # the readers' parts, where the table has them:
            "frames": None,
            **{reader.STATE_KEY: reader.state_dict(used) for reader in parts.readers
               if reader.STATE_KEY is not None},
        }
        rows = None if parts.storage is None else parts.storage.snapshot(
            lock, parts.ring.next_id % parts.ring.capacity, used, chunk_bytes)
    return TableSnapshot(state, rows), arena.wanted


def load_parts(config: TableConfig, state: Mapping[str, Any], current: TableParts,
               read_rows: Callable[[dict], None] | None = None,
               incarnations: IncarnationSource | None = None,
               memory: MemoryLedger | None = None) -> TableParts:
    """Fresh parts holding ``state``, for a table whose parts are ``current`` (not changed:
    the table swaps the new parts in once they loaded completely, so a malformed state
    changes nothing; the cost is twice the table's memory while loading, except for a
    table that never held a row, whose storage is loaded into: no second copy, for a
    ``memmap`` table no second file).

    The rows come from ``state["columns"]``, or from ``read_rows`` if given:
    it is called with numpy views of the fresh table's whole columns (bfloat16
    as int16), e.g. to read them from files; what it raises propagates as is.
    The restored ids keep their segments, and a new segment (of
    ``incarnations``) begins where the saved ring stopped, so no id the saved
    table (or a run that went on after it and crashed) issued is issued again.

    Raises:
        ConfigError: another layout version, or the state contradicts the config
            (capacity, sampler, slice_len, alpha, keys) or the table's schema (the
            message names both values), or was saved by another shard.
        MalformedStateError: the state is malformed.
        InsufficientMemoryError: the saved schema needs more than ``memory`` allows.
        MemoryError, OSError: the machine failed (never taken for a malformed state).
    """
    reuse = current.storage if current.ring.next_id == 0 else None
    try:
        parts = _load(config, state, current.schema, read_rows is None, incarnations, memory,
                      reuse)
    except (ConfigError, InsufficientMemoryError, MemoryError, OSError):
        raise  # a contradiction, or the machine failing: not a malformed state
    except Exception as exc:
        raise MalformedStateError(
            f"table {config.name!r}: saved state is malformed ({type(exc).__name__}: {exc})"
        ) from exc
    if read_rows is not None and parts.storage is not None:
        views = parts.storage.load_views()
        read_rows(views)
        parts.storage.loaded(views)
    return parts


def check_saved_config(config: TableConfig, saved: Mapping[str, Any]) -> None:
    """Refuse a saved state's ``config`` (plain values) that contradicts ``config``.

    Raises:
        ConfigError: naming the table, the field and both values.
    """
    name, mine = config.name, config.describe()
    for key in (*_MUST_MATCH, *_SLICE_SHAPE):
        theirs = saved.get(key, _SLICE_SHAPE[key]) if key in _SLICE_SHAPE else saved[key]
        if theirs != mine[key]:
            raise ConfigError(f"table {name!r}: config says {key}={mine[key]!r} but the saved "
                              f"state has {key}={theirs!r}")
    saved_key = saved.get("frame_stack_key")
    if saved_key != config.frame_stack_key:
        raise ConfigError(f"table {name!r}: config says frame_stack_key="
                          f"{config.frame_stack_key!r} but the saved state has "
                          f"frame_stack_key={saved_key!r} (its rows are stored differently)")


def _load(config: TableConfig, state: Mapping[str, Any], schema_now: Schema | None,
          with_columns: bool, incarnations: IncarnationSource | None,
          memory: MemoryLedger | None, reuse: ColumnStorage | None) -> TableParts:
    name = config.name
    version = state.get("version")
    if version != STATE_VERSION:
        raise ConfigError(f"table {name!r}: saved state has layout version {version!r}, this "
                          f"server reads version {STATE_VERSION}")
    check_saved_config(config, state["config"])
    promise = memory_promise(config, memory)
    parts = fresh_parts(config, incarnations, promise, reuse)
    schema = None if state["schema"] is None else Schema.from_state_dict(state["schema"])
    if schema_now is not None and schema is not None and dict(schema) != dict(schema_now):
        raise ConfigError(f"table {name!r}: the table's schema is {schema_now.describe()} but "
                          f"the saved state has {schema.describe()}")
    if schema is not None and parts.storage is None:
        if memory is not None:
            memory.require(name, table_bytes(config, schema),
                           f"capacity {config.capacity:,} x {schema.row_bytes:,} bytes per row "
                           f"(the saved schema {schema.describe()})")
        parts.allocate(schema, config, promise(schema), reuse)
    parts.ring.load_state_dict(state["ring"])
    parts.ids.load(state.get("ids"), parts.ring.next_id, name)
    if parts.storage is not None and with_columns:
        used = parts.used
        stored = parts.storage.views
        for key, column in state["columns"].items():
            if key not in stored or column.shape[0] != used:
                raise MalformedStateError(f"table {name!r}: saved column {key!r} does not fit "
                                          f"the schema and {used} stored slots")
        parts.storage.load_state_dict(state["columns"], parts.ring.next_id % parts.ring.capacity)
    parts.sampler.load_state_dict(state["sampler"])
    load_remover(parts.remover, _times_sampled(config, state, parts), name)
    for reader in parts.readers:
        key = reader.STATE_KEY
        saved = None if key is None else state.get(key)
        if saved is not None:
            reader.load_state_dict(saved)
        elif key == "nstep" and parts.ring.next_id > parts.ring.first_live:
            raise ConfigError(f"table {name!r}: config says n_step={config.n_step} but the "
                              f"saved state has no n-step index (saved with n_step=1)")
    parts.limiter.load_state_dict(state.get("rate_limiter"), size=parts.size)
    parts.counters = TableCounters(**state["counters"])
    parts.generator.bit_generator.state = generator_from_state(state["generator"])
    return parts


def _times_sampled(config: TableConfig, state: Mapping[str, Any],
                   parts: TableParts) -> dict[str, Any] | None:
    """The saved remover state; for a queue table saved before queues had a remover,
    made from its runs (the rows present): a live row outside them was taken."""
    saved = state.get("times_sampled")
    if saved is not None or parts.remover is None or config.max_times_sampled:
        return saved
    runs = state["sampler"]["runs"].numpy()
    ring = parts.ring
    used = parts.used
    counts = torch.ones(used, dtype=torch.int64)
    for start, end in zip(runs[0].tolist(), runs[1].tolist()):
        counts[torch.from_numpy(ring.slots(ring.range(start, end - start)))] = 0
    return {"limit": 1, "counts": counts}
