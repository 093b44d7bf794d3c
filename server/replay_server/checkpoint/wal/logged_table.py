"""A table whose acknowledged changes are in the write-ahead log before they are answered.

:class:`LoggedTable` is a :class:`~replay_server.engine.table.Table` that,
once a :class:`~replay_server.checkpoint.wal.log.WriteAheadLog` is attached
(:meth:`LoggedTable.attach`), logs each insert, priority update, reset,
delete and queue take the way every logged object does
(:mod:`~replay_server.checkpoint.wal.logged`: applied and queued under the
table's order lock, waited for outside it); a snapshot (a checkpoint)
records the log sequence number it covers, taken under the order lock at
its instant, so a restore replays exactly the records after it.

**Queue takes** (tables whose sampler consumes its rows: ``fifo``/``lifo``)
are logged when rows leave the queue for good: an unleased sample's rows
when it is drawn, a leased sample's when its lease is acknowledged (in
whole or in part). A ``TAKE`` record holds their ids (slice starts on a
slice table); replay retires those rows again (:meth:`LoggedTable.retire`:
idempotent, rows gone already are ignored). A lease taken and not
acknowledged is not logged: after a crash its rows are in the queue again
(the checkpoint saved them as given back). Draw counts below
``max_times_sampled`` are not logged. A take or an acknowledgement is never
refused for the log: if the log cannot be written it is made unlogged (after
a crash those rows are delivered again, at least once).

Not logged (they come back as the last checkpoint had them after a crash):
samples of other tables, draw settings, rows written by position. Publishes
of named variables are logged by
:mod:`~replay_server.checkpoint.wal.logged_variables`. Without a log attached
every method is :class:`Table`'s own.

Inserts are logged as the columns the table was handed (after conversion,
episode ids a TensorDict got included), so replay stores the same bytes; a
compressed column (``compress_keys``, lz4) as the blocks the table stored
(compressed once, before the table's lock; about a tenth of Atari frames'
raw bytes), which replay decompresses into the rows it inserts again (lz4
is lossless: the same bytes). A frame-stacked column is logged raw (the
table stores only its newest frame).

Thread-safety: as :class:`Table`; the order lock serializes a table's
changes while a log is attached (a sample's draw is not under it: a take's
record is queued right after, and replaying it is idempotent, so a
checkpoint whose instant falls between the two holds the same queue).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from replay_proto.batch import SampleBatch
from replay_proto.keys import unflatten

from replay_server.checkpoint.wal import records
from replay_server.checkpoint.wal.log import Durable, WriteAheadLog
from replay_server.checkpoint.wal.logged import LoggedChanges, Made
from replay_server.engine import (
    DEFAULT_CHUNK_BYTES,
    LeaseRequest,
    Table,
    TableSnapshot,
    columns_of,
    retire_rows,
    retired_ids,
    settle_taking,
)
from replay_server.errors import LogWriteError

LOG_SEQ_KEY = "wal_seq"
"""Where a table's state (a checkpoint's) holds the log sequence number it covers."""


class LoggedTable(LoggedChanges, Table):
    """A :class:`Table` that logs its changes once a log is attached (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_logging()
        self._compressed: dict[str, list[bytes]] = {}  # the last insert's (see _append)

    def _record_meta(self) -> dict[str, Any]:
        return {"table": self.name}

    def insert(self, data: Any, priorities: Any = None) -> torch.Tensor:
        log = self._log
        if log is None:
            return super().insert(data, priorities)
        columns = columns_of(data, self.name, self.config.episode_key)
        given = None if priorities is None else _array(priorities)
        # Checked, converted and compressed before the order lock, as Table.insert does before
        # its own: concurrent inserts of a table compress at once (lz4 releases the GIL).
        batch = self.prepare_insert(unflatten(columns), given)
        return self._logged(log, _nbytes(columns, given), lambda: Table.insert(self, batch),
                            self._insert_record(columns, given))

    def insert_now(self, data: Any, priorities: Any = None) -> torch.Tensor | None:
        if self._log is not None:
            return None  # waiting for the log is blocking: the caller goes off its loop
        return super().insert_now(data, priorities)

    def insert_now_durable(self, data: Any, priorities: Any,
                           durable: Durable) -> tuple[torch.Tensor, bool] | None:
        """:meth:`Table.insert_now_durable`: with a log attached, the insert is stored and its
        record queued now if that is quick (the log takes it without an early checkpoint,
        the order lock and the table's lock are free this instant, the storage is quick to
        write), and ``durable`` is told once the record is (:meth:`WriteAheadLog.when_durable`,
        which at ``"os"`` may write it right here)."""
        log = self._log
        if log is None:
            return super().insert_now_durable(data, priorities, durable)
        if not self.quick_to_write():
            return None
        columns = columns_of(data, self.name, self.config.episode_key)
        given = None if priorities is None else _array(priorities)
        batch = self.prepare_insert(unflatten(columns), given)
        if not log.may_admit(_nbytes(columns, given)):
            return None  # full or broken: the blocking path checkpoints early, or refuses
        if not self._order.acquire(False):
            return None
        try:
            if self._log is not log:
                return None  # detached since the look above
            ids = Table.insert_now(self, batch)
            if ids is None:
                return None
            made = self._insert_record(columns, given)(ids)
            number = None if made is None else self._queue_record(log, *made)
        finally:
            self._order.release()
        if number is None:
            return ids, False
        log.when_durable(number, durable, lead=True)
        return ids, True

    def _insert_record(self, columns: dict[str, Any],
                       given: np.ndarray | None) -> Callable[[torch.Tensor], Made | None]:
        """What makes an insert's record once it is applied (under the order lock): its
        columns as handed, a compressed one as the blocks the table stored."""

        def record(ids: torch.Tensor) -> Made | None:
            compressed, self._compressed = self._compressed, {}
            if len(ids) == 0:
                return None
            tensors: dict[str, Any] = {}
            shapes: dict[str, Any] = {}
            for key, value in columns.items():
                if key in compressed:  # the blocks the table stored, not the raw rows
                    tensors[f"z:{key}"] = records.packed_blocks(compressed[key])
                    shapes[key] = [str(value.dtype).removeprefix("torch."), list(value.shape[1:])]
                else:
                    tensors[f"c:{key}"] = value
            if given is not None:
                tensors["priorities"] = given
            meta: dict[str, Any] = {"first_id": int(ids[0])}
            if shapes:
                meta.update(z=shapes, rows=len(ids))
            return records.INSERT, meta, tensors

        return record

    def _append(self, parts: Any, batch: Any, encoded: Any,  # type: ignore[override]
                episodes: dict[str, Any]) -> int:
        """:meth:`Table._append`, keeping the blocks of the insert's compressed columns (lz4)
        that hold its rows as handed (not a frame stack's reduced ones) for the record: the
        log holds what the table already compressed, never compressed twice. Under the
        table's lock; read by :meth:`insert` under the order lock."""
        columns = batch.columns
        stored = parts.stored(columns)
        self._compressed = {key: value for key, value in encoded.items()
                            if isinstance(value, list) and stored[key] is columns[key]}
        return Table._append(parts, batch, encoded, episodes)

    def update_priorities(self, ids: Any, priorities: Any, *,
                          blocking: bool = True) -> int | None:
        log = self._log
        if log is None:
            return super().update_priorities(ids, priorities, blocking=blocking)
        if not blocking:
            return None  # waiting for the log is blocking: the caller goes off its loop
        id_array, values = _array(ids), _array(priorities)
        return self._logged(log, id_array.nbytes + values.nbytes,
                            lambda: Table.update_priorities(self, id_array, values),
                            lambda _: (records.PRIORITIES, {},
                                       {"ids": id_array, "priorities": values}))

    def update_priorities_now_durable(self, ids: Any, priorities: Any,
                                      durable: Durable) -> tuple[int, bool] | None:
        """:meth:`Table.update_priorities_now_durable`: with a log attached, applied and its
        record queued now if the log takes it without an early checkpoint and the order lock
        and the table's lock are free this instant; ``durable`` is told once the record is
        (as :meth:`insert_now_durable`)."""
        log = self._log
        if log is None:
            return super().update_priorities_now_durable(ids, priorities, durable)
        id_array, values = _array(ids), _array(priorities)
        if not log.may_admit(id_array.nbytes + values.nbytes) or not self._order.acquire(False):
            return None
        try:
            if self._log is not log:
                return None  # detached since the look above
            applied = Table.update_priorities(self, id_array, values, blocking=False)
            if applied is None:
                return None
            number = self._queue_record(log, records.PRIORITIES, {},
                                        {"ids": id_array, "priorities": values})
        finally:
            self._order.release()
        log.when_durable(number, durable, lead=True)
        return applied, True

    def reset(self, *, schema: bool = False) -> None:
        log = self._log
        if log is None:
            return super().reset(schema=schema)
        self._logged(log, 0, lambda: Table.reset(self, schema=schema),
                     lambda _: (records.RESET, {"schema": bool(schema)}, {}))

    def delete(self, ids: Any) -> int:
        log = self._log
        if log is None:
            return super().delete(ids)
        id_array = _array(ids)
        return self._logged(log, id_array.nbytes, lambda: Table.delete(self, id_array),
                            lambda _: (records.DELETE, {}, {"ids": id_array}))

    def sample(self, batch_size: int, *, out: Mapping[str, torch.Tensor] | None = None,
               lease: LeaseRequest | None = None) -> SampleBatch:
        batch = super().sample(batch_size, out=out, lease=lease)
        log = self._log
        if log is not None and lease is None and self.config.sampler.traits.consumes:
            ids = batch.ids.detach().cpu().numpy()
            heads = ids[:, 0] if ids.ndim == 2 else ids  # a slice is taken by its start
            self._log_taken(log, lambda parts: retired_ids(parts, self.name, heads))
        return batch

    def settle_leases(self, acknowledge: Iterable[str] = (), give_back: Iterable[str] = (),
                      acknowledge_first: tuple[str, int] | None = None) -> int:
        log = self._log
        acknowledge = list(acknowledge)
        if log is None or (not acknowledge and acknowledge_first is None):
            return super().settle_leases(acknowledge, give_back, acknowledge_first)
        back = 0

        def settle(parts: Any) -> np.ndarray:
            nonlocal back
            ids, back = settle_taking(parts, acknowledge, give_back, acknowledge_first)
            return ids

        self._log_taken(log, settle)
        if back:
            self.changes.tick()
        return back

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

    def retire(self, ids: np.ndarray) -> int:
        """Replay a logged take: the rows ``ids`` (still present) leave the queue for good.
        Returns how many left now (rows gone already are ignored: replay is idempotent)."""
        with self._lock:
            retired = retire_rows(self._parts, self.name, ids)
            self.changes.tick()
        return retired

    def _log_taken(self, log: WriteAheadLog, taken: Callable[[Any], np.ndarray]) -> None:
        """Log the rows a take or an acknowledgement made leave for good (``taken``, run under
        the table's lock, applies it and returns their ids), and wait for it.

        Takes and acknowledgements are never refused for the log: if it cannot be written
        (full, broken) the change stays made and is not logged, so after a crash those rows
        are delivered again (at least once, as without a log)."""
        with self._order:
            with self._lock:  # a Table's own parts, as Table's methods take them
                ids = taken(self._parts)
            if ids.size == 0:
                return
            try:
                number = self._queue_record(log, records.TAKE, {}, {"ids": ids})
            except LogWriteError:
                return
        try:
            log.wait(number)
        except LogWriteError:
            pass


def _nbytes(columns: dict[str, Any], given: np.ndarray | None) -> int:
    """An insert's bytes as the log's bound counts them."""
    return sum(c.nbytes for c in columns.values()) + (0 if given is None else given.nbytes)


def _array(value: Any) -> np.ndarray:
    """``value`` as a host numpy array (what the table is then handed, and the log holds)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
