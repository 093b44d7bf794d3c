"""A table whose acknowledged changes are in the write-ahead log before they are answered.

:class:`LoggedTable` is a :class:`~replay_server.engine.table.Table` that,
once a :class:`~replay_server.checkpoint.wal.log.WriteAheadLog` is attached
(:meth:`LoggedTable.attach`), logs each insert, priority update, reset and
delete: the change is applied and its record queued under the table's
*order lock* (so the log holds a table's changes in the order they were
applied, which replay repeats), then the call waits, outside that lock, for
the record to be durable (group commit with every other waiting call). Each
record carries the table's log sequence number :attr:`LoggedTable.log_seq`;
a snapshot (a checkpoint) records the number it covers, taken under the
order lock at its instant, so a restore replays exactly the records after it.

Not logged (they come back as the last checkpoint had them after a crash):
samples and their leases (queue takes and acknowledgements), draw settings,
rows written by position. Publishes of named variables are logged by
:mod:`~replay_server.checkpoint.wal.logged_variables`. Without a log attached every method is
:class:`Table`'s own.

Inserts are logged as the columns the table was handed (after conversion,
episode ids a TensorDict got included), so replay stores the same bytes.

Thread-safety: as :class:`Table`; the order lock serializes a table's
changes (not its samples) while a log is attached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.keys import unflatten
from replay_server.checkpoint.wal import records
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.engine import DEFAULT_CHUNK_BYTES, Table, TableSnapshot, columns_of

LOG_SEQ_KEY = "wal_seq"
"""Where a table's state (a checkpoint's) holds the log sequence number it covers."""


class LoggedTable(Table):
    """A :class:`Table` that logs its changes once a log is attached (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._order = threading.Lock()
        self._log: WriteAheadLog | None = None
        self.log_seq = 0
        """The sequence number of this table's next logged change (restored with the table)."""

    def attach(self, log: WriteAheadLog | None) -> None:
        """Log every change from now on into ``log`` (``None``: stop logging)."""
        with self._order:
            self._log = log

    def insert(self, data: Any, priorities: Any = None) -> torch.Tensor:
        log = self._log
        if log is None:
            return super().insert(data, priorities)
        columns = columns_of(data, self.name, self.config.episode_key)
        given = None if priorities is None else _array(priorities)
        log.admit(sum(c.nbytes for c in columns.values()) + (0 if given is None else given.nbytes))
        with self._order:
            ids = super().insert(unflatten(columns), given)
            if len(ids) == 0:
                return ids
            tensors: dict[str, Any] = {f"c:{key}": value for key, value in columns.items()}
            if given is not None:
                tensors["priorities"] = given
            number = self._record(log, records.INSERT, {"first_id": int(ids[0])}, tensors)
        log.wait(number)
        return ids

    def update_priorities(self, ids: Any, priorities: Any, *,
                          blocking: bool = True) -> int | None:
        log = self._log
        if log is None:
            return super().update_priorities(ids, priorities, blocking=blocking)
        if not blocking:
            return None  # waiting for the log is blocking: the caller goes off its loop
        id_array, values = _array(ids), _array(priorities)
        log.admit(id_array.nbytes + values.nbytes)
        with self._order:
            applied = super().update_priorities(id_array, values)
            number = self._record(log, records.PRIORITIES, {},
                                  {"ids": id_array, "priorities": values})
        log.wait(number)
        return applied

    def reset(self, *, schema: bool = False) -> None:
        self._logged(lambda: super(LoggedTable, self).reset(schema=schema), records.RESET,
                     {"schema": bool(schema)})

    def delete(self, ids: Any) -> int:
        log = self._log
        if log is None:
            return super().delete(ids)
        id_array = _array(ids)
        log.admit(id_array.nbytes)
        with self._order:
            deleted = super().delete(id_array)
            number = self._record(log, records.DELETE, {}, {"ids": id_array})
        log.wait(number)
        return deleted

    def snapshot(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TableSnapshot:
        with self._order:  # the instant falls between two logged changes
            snap = super().snapshot(chunk_bytes)
            snap.state[LOG_SEQ_KEY] = self.log_seq
        return snap

    def load_state_dict(self, state: Mapping[str, Any],
                        read_rows: Callable[[dict], None] | None = None) -> None:
        state = dict(state)
        seq = int(state.pop(LOG_SEQ_KEY, 0))
        super().load_state_dict(state, read_rows)
        self.log_seq = seq

    def _logged(self, change: Callable[[], Any], kind: int, meta: dict[str, Any]) -> Any:
        log = self._log
        if log is None:
            return change()
        log.admit(0)
        with self._order:
            result = change()
            number = self._record(log, kind, meta, {})
        log.wait(number)
        return result

    def _record(self, log: WriteAheadLog, kind: int, meta: dict[str, Any],
                tensors: dict[str, Any]) -> int:
        """Queue the record of a change just applied (under the order lock; it is encoded and
        checksummed by the log's writer thread, the tensors unchanged until then)."""
        meta = {"table": self.name, "seq": self.log_seq, **meta}
        number = log.append(lambda: records.encode(kind, meta, tensors))
        self.log_seq += 1
        return number


def _array(value: Any) -> np.ndarray:
    """``value`` as a host numpy array (what the table is then handed, and the log holds)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
