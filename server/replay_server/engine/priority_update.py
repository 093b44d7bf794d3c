"""A priority update by id: checked before the table's lock, resolved to live rows under it.

Ids cross every boundary, slots never (the design's rule 4): an update names
rows by id, and only rows still stored take it. Ids whose rows have since been
overwritten, reset or retired, and ids of a run that crashed after its last
checkpoint, are *stale*: the table ignores and counts them. A table that mixes
priorities per slice (``priority_mixing``) takes whole slices, ``[B, slice_len]``
(or flat, ``slice_len`` per slice in order), and a slice counts as applied,
all its ids, when its start is present.

:meth:`PriorityUpdate.of` checks what a caller hands (before the lock);
:meth:`PriorityUpdate.present` finds the rows still present (under it). The
table then tells its sampler once (:meth:`~replay_server.engine.table.Table.update_priorities`).

Thread-safety: a :class:`PriorityUpdate` is immutable; :meth:`~PriorityUpdate.present`
reads the table's parts and must run under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from replay_server.engine.config import TableConfig
from replay_server.engine.id_space import IdSpace
from replay_server.engine.ids import IdRing
from replay_server.engine.inputs import id_values, priority_values
from replay_server.engine.remover import Remover
from replay_server.errors import InvalidPriorityError


@dataclass(frozen=True, slots=True)
class PriorityUpdate:
    """Checked ids and priorities of one update.

    Attributes:
        ids: int64, flat ``[n]``, or ``[B, slice_len]`` whole slices (``slices``).
        values: float64 priorities in the shape of ``ids``.
        slices: whether each row of ``ids`` is a slice whose priorities the sampler mixes.
    """

    ids: np.ndarray
    values: np.ndarray
    slices: bool

    @classmethod
    def of(cls, ids: Any, priorities: Any, config: TableConfig, alpha: float) -> PriorityUpdate:
        """The update ``ids`` and ``priorities`` ask for, in a table of ``config`` whose
        exponent in force is ``alpha`` (the bound on priorities). O(n).

        Raises:
            InvalidIdsError: ids are not int64.
            InvalidPriorityError: a priority is negative, not finite or too large for
                ``alpha``, the shapes differ, or the ids are not whole slices where the
                table mixes priorities per slice.
        """
        table = config.name
        id_array = id_values(ids, table)
        values = priority_values(priorities, table, alpha)
        if values.shape != id_array.shape:
            raise InvalidPriorityError(
                f"table {table!r}: priorities must have the same shape as ids "
                f"{list(id_array.shape)}, got {list(values.shape)}"
            )
        if config.priority_mixing is None:
            return cls(id_array.reshape(-1), values.reshape(-1), slices=False)
        length = config.slice_len
        assert length is not None
        if id_array.shape[-1:] != (length,) and (id_array.ndim > 1 or id_array.size % length):
            raise InvalidPriorityError(
                f"table {table!r} mixes priorities per slice (priority_mixing): an update "
                f"gives slice_len={length} priorities per slice (the batch's ids "
                f"[B, {length}]), got ids {list(id_array.shape)}")
        return cls(id_array.reshape(-1, length), values.reshape(-1, length), slices=True)

    @property
    def size(self) -> int:
        """How many ids the update names."""
        return int(self.ids.size)

    def present(self, ring: IdRing, id_space: IdSpace, remover: Remover | None,
                table: str) -> tuple[tuple[np.ndarray, np.ndarray] | None, int]:
        """The positions and priorities the sampler takes (``None``: no row is present) and
        how many of the ids they account for (the rest are stale). Under the table's lock.

        Raises:
            InvalidIdsError: an id is negative, of another shard, or never issued by
                this table (:mod:`~replay_server.engine.id_space`).

        Cost: O(n), plus O(n log n) where a remover keeps retired rows.
        """
        positions = id_space.positions_of(self.ids.reshape(-1), ring.next_id,
                                          table).reshape(self.ids.shape)
        heads = positions[:, 0] if self.slices else positions  # a slice stays while its start does
        # Positions are issued in order, so when the lowest is live they all are.
        lowest = int(heads.min()) if heads.size else ring.first_live
        live = None if lowest >= ring.first_live else ring.live(heads)
        if remover is not None and remover.removes_rows:  # retired: stays 0
            drawable = remover.drawable(heads)
            live = drawable if live is None else live & drawable
        present = heads.size if live is None else int(live.sum())
        applied = present * (self.size // max(1, heads.size))
        if present == heads.size:
            return (positions, self.values), applied
        if present:
            assert live is not None
            return (positions[live], self.values[live]), applied
        return None, applied
