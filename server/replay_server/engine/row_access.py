"""Rows read and overwritten where they are stored, outside sampling (TorchRL's ``rb[index]``).

A row's **position** is its place in the table's storage: ``0 .. capacity - 1``.
Rows are written at positions 0, 1, 2, ... in insertion order from the
table's creation or last reset, wrapping at capacity, which is what TorchRL
calls a storage index (``rb[0]`` is the first row written, until the ring
wraps over it). Inside the engine a row is known by its insertion number
(:mod:`replay_server.engine.ids`); its position is that number modulo the
capacity, and :meth:`IdRing.clear` starts the numbers of a reset table at a
multiple of the capacity so positions start over at 0.

Reads change nothing (no counters, rate limiter or sampler state): they
return the rows' columns as stored, their ids and, for prioritized tables,
their priorities. Writes replace whole rows in place (:func:`write`): the
row keeps its id, and a prioritized table gives it the priority a new row
gets (the largest seen so far), as TorchRL's ``rb[index] = data`` does. Rows
that other rows link to (episodes of slice tables, n-step windows, frame
stacks) cannot be overwritten, nor rows of a queue.

The table's :meth:`~replay_server.engine.table.Table.read_rows` and
:meth:`~replay_server.engine.table.Table.write_rows` are the entry points:
they run :func:`read` and :func:`write` under its lock; those two are not
thread-safe on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.ids import IdRing
from replay_server.engine.inputs import id_values, row_count
from replay_server.engine.table_parts import TableParts
from replay_server.errors import InvalidArgumentError, InvalidIdsError, NoPrioritiesError


@dataclass(frozen=True, slots=True)
class RowRead:
    """Rows read by position or id.

    Attributes:
        columns: flat key -> ``[n, ...]`` tensors as stored (``None``: not asked for).
        ids: int64 ``[n]``: each row's id.
        priorities: float64 ``[n]`` (``None``: not asked for).
        size: rows the table holds now.
    """

    columns: dict[str, torch.Tensor] | None
    ids: np.ndarray
    priorities: np.ndarray | None
    size: int


def numbers_at(parts: TableParts, positions: np.ndarray, table: str) -> np.ndarray:
    """Insertion numbers of the rows stored at ``positions`` (int64, flat).

    Raises:
        InvalidArgumentError: a position is outside ``0 .. capacity - 1`` or holds no row.
    """
    ring = parts.ring
    flat = np.asarray(positions, dtype=np.int64).reshape(-1)
    if flat.size == 0:
        return flat
    outside = (flat < 0) | (flat >= ring.capacity)
    if outside.any():
        raise InvalidArgumentError(
            f"table {table!r}: position {int(flat[outside][0])} is outside 0..{ring.capacity - 1} "
            f"(positions are storage slots; {int(outside.sum())} such positions)")
    numbers = ring.first_live + (flat - ring.first_live) % ring.capacity
    empty = numbers >= ring.next_id
    if empty.any():
        raise InvalidArgumentError(
            f"table {table!r}: position {int(flat[empty][0])} holds no row (the table holds "
            f"{ring.size} rows{_where(ring)}; {int(empty.sum())} such positions)")
    return numbers


def numbers_of(parts: TableParts, ids: np.ndarray, table: str) -> np.ndarray:
    """Insertion numbers of the stored rows named by ``ids`` (int64, flat).

    Raises:
        InvalidIdsError: an id was never issued by this table, or names a row
            that is no longer stored (overwritten or reset since).
    """
    ring = parts.ring
    flat = id_values(ids, table).reshape(-1)
    numbers = parts.ids.positions_of(flat, ring.next_id, table)
    gone = numbers < ring.first_live  # -1 for ids of older segments, too
    if gone.any():
        raise InvalidIdsError(
            f"table {table!r}: id {int(flat[gone][0])} names no stored row (it was overwritten "
            f"or the table was reset since); {int(gone.sum())} such ids")
    return numbers


def read(parts: TableParts, config: TableConfig, *, positions: Any = None, ids: Any = None,
         columns: bool = True, priorities: bool = False) -> RowRead:
    """The stored rows at ``positions`` (or named by ``ids``), as stored.

    Args:
        parts: the table's parts (its lock held).
        config: the table's config.
        positions: storage positions (see the module docstring), any integers.
        ids: row ids instead of positions.
        columns: read the rows' columns (else only ids and priorities).
        priorities: read their priorities too.

    Raises:
        InvalidArgumentError: a position holds no row. InvalidIdsError: an id
            names no stored row. NoPrioritiesError: priorities of a table without.

    Cost: one gather per column, O(rows * row bytes); priorities O(rows).
    """
    if priorities and not parts.sampler.traits.priorities:
        raise NoPrioritiesError(f"table {config.name!r} uses sampler "
                                f"{config.sampler.value!r}, which has no priorities")
    numbers = (numbers_at(parts, positions, config.name) if ids is None
               else numbers_of(parts, ids, config.name))
    ring = parts.ring
    found = None
    if columns:
        found = {} if parts.storage is None else parts.row_reader(config).read(numbers)
    values = parts.sampler.priorities(numbers) if priorities else None
    return RowRead(found, parts.ids.ids_of(numbers, ring.first_live), values, parts.size)


def write(parts: TableParts, config: TableConfig, positions: Any,
          columns: Mapping[str, torch.Tensor]) -> None:
    """Overwrite the stored rows at ``positions`` by ``columns`` (whole rows, already converted).

    A repeated position keeps its last row. Cost: one copy per run of
    consecutive positions per column; a prioritized table's sampler update.

    Raises:
        InvalidArgumentError: a position holds no row, the rows do not match the
            positions, or the table's rows are linked (see the module docstring).
        SchemaMismatchError: the rows do not match the table's schema.
    """
    _check_writable(parts, config)
    numbers = numbers_at(parts, positions, config.name)
    rows = row_count(columns, config.name)
    if numbers.size != rows:
        raise InvalidArgumentError(f"table {config.name!r}: {numbers.size} positions for "
                                   f"{rows} rows")
    if not rows:
        return
    assert parts.schema is not None and parts.storage is not None  # it holds rows
    parts.schema.check(columns, config.name)
    slots = parts.ring.slots(numbers)
    last = {int(slot): i for i, slot in enumerate(slots)}  # a repeated slot: the last row wins
    order = np.fromiter(sorted(last), dtype=np.int64, count=len(last))
    chosen = np.fromiter((last[int(s)] for s in order), dtype=np.int64, count=order.size)
    breaks = np.flatnonzero(np.diff(order) != 1) + 1
    storage = parts.storage
    runs = []
    for run in np.split(np.arange(order.size), breaks):
        take = torch.from_numpy(chosen[run])
        encoded = storage.encode(parts.stored({k: v[take] for k, v in columns.items()}))
        storage.reserve(int(order[run[0]]), encoded)  # may refuse: nothing written yet
        runs.append((int(order[run[0]]), encoded))
    for first_slot, encoded in runs:
        storage.write(first_slot, encoded)
    if parts.sampler.traits.priorities:
        written = parts.ring.ids_of_slots(order)
        parts.sampler.update(written, np.full(order.size, parts.sampler.max_priority))


def _check_writable(parts: TableParts, config: TableConfig) -> None:
    """Refuse overwriting rows of a table whose rows are linked (naming the setting)."""
    traits = parts.sampler.traits
    linked = [name for name, on in (
        ("its episodes (slice samplers link each step to the next)", traits.episodes),
        ("its queue (rows are handed out once)", traits.consumes),
        ("n_step > 1 (samples read each row's successors)", config.n_step > 1),
        ("frame_stack_key (stacks are rebuilt from neighbouring rows)",
         config.frame_stack_key is not None),
    ) if on]
    if linked:
        raise InvalidArgumentError(
            f"table {config.name!r}: rows cannot be overwritten in place because of "
            f"{linked[0]}; insert new rows instead")


def _where(ring: IdRing) -> str:
    """Where the rows of a ring are stored, in words."""
    if ring.size == 0:
        return ""
    first, last = ring.first_live % ring.capacity, (ring.next_id - 1) % ring.capacity
    if first <= last:
        return f" at positions {first}..{last}"
    return f" at positions {first}..{ring.capacity - 1} and 0..{last}"
