"""Named variables whose publishes are in the write-ahead log before they are answered.

:class:`LoggedVariableStore` is a :class:`~replay_server.engine.variables.VariableStore`
that, with a log attached, stores each publish and queues its record (the
name, the version it got, its layout and bytes) under an order lock, then
waits outside it for the record to be durable, as
:mod:`~replay_server.checkpoint.wal.logged_table` does for tables. Its log
sequence number :attr:`LoggedVariableStore.log_seq` is saved with the
variables of a checkpoint (:meth:`LoggedVariableStore.snapshot`, under the
order lock) and restored with them, so replay applies exactly the publishes
after it, each to the version it had.

Thread-safety: as :class:`VariableStore`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay_server.checkpoint.wal import records
from replay_server.checkpoint.wal.logged import LoggedChanges
from replay_server.engine import Variable, VariableStore


class LoggedVariableStore(LoggedChanges, VariableStore):
    """A :class:`VariableStore` that logs its publishes once a log is attached."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self._start_logging()

    def _record_meta(self) -> dict[str, Any]:
        return {"variables": True}

    def snapshot(self) -> tuple[list[Variable], int]:
        """Every variable's newest version and the log sequence number they cover (one instant)."""
        with self._order:
            return self.variables(), self.log_seq

    def replayed(self, version: int, name: str, layout: bytes, data: np.ndarray) -> None:
        """Replay a logged publish: it must get the version it got then.

        Raises:
            ValueError: it would get another version (the log and the checkpoint disagree).
        """
        variable = VariableStore._store(self, name, layout, data, 0)
        if variable.version != version:
            raise ValueError(f"variable {name!r} got version {variable.version} where the log "
                             f"says {version}")

    def _store(self, name: str, layout: bytes, data: np.ndarray, keys: int) -> Variable:
        log = self._log
        if log is None:
            return super()._store(name, layout, data, keys)
        return self._logged(
            log, len(layout) + data.nbytes,
            lambda: VariableStore._store(self, name, layout, data, keys),
            lambda variable: (records.PUBLISH, {"name": name, "version": variable.version},
                              {"layout": np.frombuffer(layout, dtype=np.uint8), "data": data}))
