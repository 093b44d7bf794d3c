"""An insert's rows as a table takes them: what a caller hands, checked and converted once.

Rows reach a table from the service (read-only tensor views of the request's
bytes, decoded by :mod:`replay_proto.messages`), from an in-process caller
(any mapping or TensorDict, tensors or arrays) or from a replayed write-ahead
log. :meth:`InsertRows.of` is the server's one normalisation of them, made
before the table's lock: flat key -> tensor (CPU, or a device table's device
for tensors already there), each of a dtype a table stores and with a leading
dim of rows, one row count for all; priorities checked (one per row, finite,
>= 0, within the bound of the exponent in force); a frame-stacked table's
observations checked against their next ones. What depends on the schema,
which the first insert fixes under the lock, is checked there by the table:
keys, dtypes and per-row shapes, then each row's episode id and end flag
(:meth:`InsertRows.episodes`).

Every refusal is a :class:`~replay_server.errors.ReplayServerError` naming the
table and the key or value, raised before anything is stored.

Thread-safety: an :class:`InsertRows` is immutable (its tensors are not copied:
the caller must not change them until the insert returns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.inputs import check_bound, columns_of, priority_values, row_count
from replay_server.engine.readers.framestack import check_insert as check_stacks
from replay_server.errors import InvalidPriorityError, NoPrioritiesError


@dataclass(frozen=True, slots=True)
class InsertRows:
    """The rows of one insert, checked (see the module docstring).

    Attributes:
        columns: flat key -> tensor whose leading dim is :attr:`rows`.
        rows: how many rows.
        priorities: float64 ``[rows]``, or ``None`` when none were given.
        alpha: the exponent :attr:`priorities` were checked against.
        early: the rows as the storage keeps them, made before the table's lock
            (:meth:`~replay_server.engine.table_parts.TableParts.encode_early`, e.g. lz4
            blocks), or ``None``: the table makes them. A caller that orders its inserts
            with a lock of its own (the write-ahead log's) makes them before taking it,
            so that concurrent inserts still compress at once.
    """

    columns: dict[str, torch.Tensor]
    rows: int
    priorities: np.ndarray | None = None
    alpha: float | None = None
    early: Any = None

    @classmethod
    def of(cls, data: Any, priorities: Any, config: TableConfig, alpha: float | None,
           device: torch.device | None = None) -> InsertRows:
        """The rows ``data`` holds for a table of ``config`` (see the module docstring).

        Args:
            data: a mapping (nested allowed) or TensorDict of tensors or arrays, rows
                along the leading dim (:func:`~replay_proto.rows.rows_of`).
            priorities: ``[rows]`` priorities, or ``None``.
            alpha: the table's exponent in force (it may differ from the config's).
            device: a device table's device: tensors already there stay there.

        Raises:
            InvalidArgumentError: not a mapping of tensors, no columns, a scalar column,
                columns of different row counts, or frames that do not follow each other.
            SchemaMismatchError: a dtype no table stores (the message names the key).
            NoPrioritiesError: priorities for a table whose sampler has none.
            InvalidPriorityError: a priority that is not finite, negative, too large
                for ``alpha``, or not one per row.

        Cost: O(columns) when the tensors are contiguous CPU tensors of stored dtypes;
        a conversion per column otherwise; O(rows) for priorities.
        """
        table = config.name
        columns = columns_of(data, table, config.episode_key, device)
        rows = row_count(columns, table)
        if config.frame_stack_key is not None:
            check_stacks(columns, config.frame_stack_key, table)
        if priorities is None:
            return cls(columns, rows)
        if not config.sampler.traits.priorities:
            raise NoPrioritiesError(
                f"table {table!r} uses sampler {config.sampler.value!r}, which has "
                f"no priorities; insert without priorities"
            )
        bound = config.alpha if alpha is None else alpha
        values = priority_values(priorities, table, bound)
        if tuple(values.shape) != (rows,):
            raise InvalidPriorityError(
                f"table {table!r}: priorities must have shape [{rows}] (one per row), "
                f"got {list(values.shape)}"
            )
        return cls(columns, rows, values, bound)

    def check_alpha(self, alpha: float | None, table: str) -> None:
        """Refuse priorities too large for ``alpha``, the exponent in force when the rows are
        stored, if it changed since they were checked (``draw_settings``). O(rows) then, else O(1).

        Raises:
            InvalidPriorityError: a priority's sampling mass ``p ** alpha`` overflows float32.
        """
        values = self.priorities
        if values is not None and alpha is not None and alpha != self.alpha:
            check_bound(values, table, alpha)

    def episodes(self, config: TableConfig) -> dict[str, np.ndarray]:
        """Each row's episode id (int64) and end flag (``done`` or ``truncated``), as
        :class:`~replay_server.engine.insert_event.InsertEvent` takes them. Only once the
        schema check passed (the episode column is there, one integer per row). O(rows)."""
        rows = self.rows
        ends = np.zeros(rows, dtype=bool)
        for key in config.episode_end_keys:
            if key in self.columns:
                ends |= self.columns[key].detach().cpu().numpy().reshape(rows)
        episodes = self.columns[config.episode_key].detach().cpu().numpy().astype(np.int64)
        return {"episodes": episodes, "ends": ends}
