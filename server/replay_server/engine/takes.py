"""The rows a take or an acknowledgement made leave a queue for good, and retiring them again.

A table whose rows leave when sampled (``fifo``/``lifo``, ``max_times_sampled``)
changes on a take or a lease's acknowledgement, not only on inserts: the
write-ahead log (:mod:`replay_server.checkpoint.wal.logged_table`) records the
ids of the rows such a change made leave for good, and replays them with
:func:`retire_rows`. These functions act on a table's parts and are called under the
table's lock by the table (or a subclass of it); cost O(rows named).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from replay_server.engine.table_parts import TableParts


def retired_ids(parts: TableParts, table: str, heads: np.ndarray) -> np.ndarray:
    """The ids among ``heads`` (a batch's rows, or its slices' starts) that no longer can be
    drawn: the rows the batch took for good."""
    if parts.remover is None or heads.size == 0:
        return np.empty(0, dtype=np.int64)
    positions = parts.ids.positions_of(heads, parts.ring.next_id, table)
    live = parts.ring.live(positions)
    positions, heads = positions[live], heads[live]
    return np.unique(heads[~parts.remover.drawable(positions)])


def settle_taking(parts: TableParts, acknowledge: list[str], give_back: Iterable[str],
                  first: tuple[str, int] | None) -> tuple[np.ndarray, int]:
    """Settle leases as :meth:`TableParts.settle_leases` does; the ids of the rows the
    acknowledgements made leave for good (those still stored), and the rows that came back."""
    leases = parts.leases
    held = {name: lease.positions for name in [*acknowledge, *([first[0]] if first else [])]
            if (lease := leases.get(name)) is not None}
    back = parts.settle_leases(acknowledge, give_back, first)
    if first is not None and first[0] in held and (lease := leases.get(first[0])) is not None:
        held[first[0]] = np.setdiff1d(held[first[0]], lease.positions)
    if not held:
        return np.empty(0, dtype=np.int64), back
    positions = np.unique(np.concatenate(list(held.values())))
    positions = positions[parts.ring.live(positions)]
    return parts.ids.ids_of(positions, parts.ring.first_live), back


def retire_rows(parts: TableParts, table: str, ids: np.ndarray) -> int:
    """A logged take replayed: the rows ``ids`` (still present) leave the queue for good.
    Returns how many left now (rows gone already are ignored: replay is idempotent)."""
    assert parts.remover is not None
    positions = parts.ids.positions_of(ids, parts.ring.next_id, table)
    positions = np.unique(positions[parts.ring.live(positions)])
    retired = parts.remover.delete(parts.sampler, positions)
    parts.counters.retired += retired
    parts.limiter.deleted(retired if parts.remover.removes_rows else 0)
    return int(retired)
