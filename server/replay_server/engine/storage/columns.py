"""A table's storage: its columns, each kept by its own backend, written and gathered together.

:class:`ColumnStorage` holds one :class:`~replay_server.engine.storage.base.Column`
per flat key (built by :func:`~replay_server.engine.storage.make_storage`
from the config) and is what the rest of the engine sees of rows: writes of
an insert's columns at consecutive slots, gathers of any slots (``[B]`` or
``[B, L]``) into batch tensors, consistent snapshots, restores and figures.
It never asks which backend a column has: a column gathers into a tensor on
its own device, and where that is not the batch's (a host column of a
device table) the storage copies once.

An insert is written in three steps, so that nothing can fail once the
table changed anything: :meth:`ColumnStorage.encode` (the rows as stored,
e.g. compressed: before the table's lock), :meth:`ColumnStorage.reserve`
(room for them: memory promised, disk reserved; may refuse) and
:meth:`ColumnStorage.write`.

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_proto.dtypes import numpy_view
from replay_server.engine import buffers
from replay_server.engine.prefault import Prefaulter
from replay_server.engine.schema import Schema
from replay_server.engine.snapshot import DEFAULT_CHUNK_BYTES, StorageSnapshot
from replay_server.engine.storage.base import HOST, Column
from replay_server.engine.storage.placement import pin_staging


class ColumnStorage:
    """The columns of ``capacity`` rows of ``schema`` (see the module docstring).

    Args:
        schema: the stored columns.
        capacity: rows per column.
        columns: each key's column.
        device: where batches are handed out (``None``: the host).
        check: called before device columns are first allocated (raises to refuse).
        prefault: keys of RAM columns to make resident ahead of the write cursor.
    """

    def __init__(self, schema: Schema, capacity: int, columns: dict[str, Column], *,
                 device: torch.device | None = None, check: Callable[[], None] | None = None,
                 prefault: Iterable[str] = ()) -> None:
        self.schema = schema
        self.capacity = capacity
        self.columns = columns
        self.device = HOST if device is None else device
        self._on_device = device is not None
        self._pin = pin_staging(self.device)
        self._check = check
        self._snapshots: list[StorageSnapshot] = []
        self._prefault = [key for key in prefault]
        row = sum(schema[key].row_bytes for key in self._prefault)
        self._prefaulter = Prefaulter(capacity, row) if self._prefault else None

    @property
    def pinned(self) -> bool:
        """Whether any column's memory is page-locked."""
        return any(column.pinned for column in self.columns.values())

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the columns whose memory is page-locked (host memory the OS cannot page
        out or move: what a CUDA host's device copies read without a staging copy)."""
        return sum(column.nbytes for column in self.columns.values() if column.pinned)

    @property
    def nbytes(self) -> int:
        """Bytes the columns hold now."""
        return sum(column.nbytes for column in self.columns.values())

    @property
    def quick_writes(self) -> bool:
        """Whether writing a few rows is plain copies into host memory that is there (every
        column a RAM one, allocated, no device): what a caller that must not wait asks."""
        return not self._on_device and all(
            column.quick_writes and column.allocated for column in self.columns.values())

    @property
    def allocated(self) -> bool:
        """Whether every column holds its memory (device columns are allocated on first use)."""
        return all(column.allocated for column in self.columns.values())

    def prepare(self) -> None:
        """Get ready for the first write: device columns are checked and allocated here.

        Raises:
            InsufficientMemoryError: the device cannot hold them; nothing changed.
        """
        if self.allocated:
            return
        if self._check is not None:
            self._check()
        for column in self.columns.values():
            column.prepare()

    # ------------------------------------------------------------------ writes

    def encode(self, columns: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The rows as each column stores them (compressed where a codec is): no table state
        is read, so the table calls it before taking its lock."""
        return {key: column.encode(columns[key]) for key, column in self.columns.items()}

    def reserve(self, first_slot: int, encoded: Mapping[str, Any]) -> None:
        """Room for ``encoded`` at ``first_slot``, or a refusal before anything changed.

        Raises:
            InsufficientMemoryError: memory or disk for the rows was refused.
        """
        self.prepare()
        for key, column in self.columns.items():
            column.reserve(first_slot, encoded[key])

    def write(self, first_slot: int, encoded: Mapping[str, Any]) -> None:
        """Write the encoded rows at slots ``first_slot, first_slot + 1, ...`` (wrapping).

        Cost: one copy per column (two where the range wraps; see each backend).
        While the table fills, the pages of RAM columns after the write are made
        resident in the background (:mod:`~replay_server.engine.prefault`).
        """
        n = len(next(iter(encoded.values())))
        for snapshot in self._snapshots:
            snapshot.before_write(first_slot, n)
        for key, column in self.columns.items():
            column.write(first_slot, encoded[key])
        if self._prefaulter is not None:
            self._prefaulter.advance([self.columns[key].view for key in self._prefault],
                                     (first_slot + n) % self.capacity)

    # ----------------------------------------------------------------- gathers

    def gather(
        self, slots: np.ndarray, out: Mapping[str, torch.Tensor] | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy the rows at ``slots`` (integers, any shape ``S``) into tensors ``[*S, ...]``.

        Args:
            slots: the slots to read.
            out: optional destination per key (contiguous, shaped ``[*S, ...]``,
                the column's dtype), e.g. a shared-memory or pinned staging
                buffer; new tensors (on the batch's device) for keys it lacks.
            keys: the columns to read (default: all).

        Cost: one gather per column (see each backend), O(rows gathered * row bytes).
        """
        flat = slots if slots.ndim == 1 and slots.dtype == np.int64 else \
            np.ascontiguousarray(slots.reshape(-1), dtype=np.int64)
        n = flat.size
        result = {}
        here = self.device
        for key in self.columns if keys is None else keys:
            column = self.columns[key]
            spec = column.spec
            dest = None if out is None else out.get(key)
            if dest is None and column.device is here or dest is None and column.device == here:
                rows = column.gather(flat, self.device)
                result[key] = rows if slots.ndim == 1 else rows.view(*slots.shape, *spec.shape)
                continue
            if dest is None:
                dest = buffers.empty((n, *spec.shape), spec.dtype, self.device)
                result[key] = dest.view(*slots.shape, *spec.shape)
            else:
                result[key] = dest
            target = dest.view(n, *spec.shape)
            if target.device == column.device or column.device != HOST:
                column.take(flat, target)  # a device column copies to a host target itself
            else:  # a host column of a device table: gather on the host, one copy over
                staging = torch.empty(target.shape, dtype=spec.dtype, pin_memory=self._pin)
                column.take(flat, staging)
                target.copy_(staging, non_blocking=self._pin)
        return result

    def gather_regions(self, regions: Sequence[tuple[Sequence[tuple[str, np.ndarray]],
                                                      torch.Tensor]]) -> None:
        """For every region ``(parts, into)``: ``into[:, j]`` = the rows of column
        ``parts[j][0]`` at slots ``parts[j][1]`` (each ``[n]``; the columns share one spec),
        e.g. an observation's frame stack and the next observation's, three frames of one
        column and the newest of another. One pass where the columns' backend has one
        (lz4: one decode of each distinct stored row, see
        :meth:`~replay_server.engine.storage.compressed.Lz4Column.take_regions`), else one
        gather per part.

        Cost: at most as :meth:`gather` of every part's rows.
        """
        taken = [([(self.columns[key], slots) for key, slots in parts], into)
                 for parts, into in regions]
        first = taken[0][0][0][0]
        if all(first.device == into.device for _, into in regions) and first.take_regions(taken):
            return
        for parts, into in regions:
            for j, (key, slots) in enumerate(parts):
                self.gather(slots, {key: into[:, j]}, [key])

    def place(self, batch: SampleBatch, out: Mapping[str, torch.Tensor] | None) -> SampleBatch:
        """A device table's batch without ``out``: its ids, weights and probabilities join
        its rows on the device. Any other batch as it is."""
        if out is not None or not self._on_device:
            return batch
        extras = []
        for tensor in batch.extras:
            if self._pin:
                tensor = tensor.pin_memory()
            extras.append(tensor.to(self.device, non_blocking=self._pin))
        return SampleBatch.from_flat(batch.columns, extras, batch.mass, batch.missing_shards)

    # ------------------------------------------------------------ the rest

    def stats(self) -> dict[str, Any]:
        """Storage figures for ``info``: the compression ratio of compressed columns."""
        raw = stored = 0
        for column in self.columns.values():
            figures = column.stats()
            raw += figures.get("raw_bytes", 0)
            stored += figures.get("stored_bytes", 0)
        if not any("stored_bytes" in column.stats() for column in self.columns.values()):
            return {}
        return {"compression_ratio": raw / stored if stored else 1.0}

    @property
    def views(self) -> dict[str, Any]:
        """Each column as snapshots slice it (numpy arrays for plain host columns)."""
        return {key: column.view for key, column in self.columns.items()}

    def load_views(self) -> dict[str, Any]:
        """What a checkpoint's rows are read into (then call :meth:`loaded`)."""
        self.prepare()
        return {key: column.load_view() for key, column in self.columns.items()}

    def loaded(self, views: Mapping[str, Any]) -> None:
        """The rows of :meth:`load_views` were read (nothing left to do)."""

    def snapshot(
        self, lock: threading.Lock, next_slot: int, used: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> StorageSnapshot:
        """Begin a :class:`~replay_server.engine.snapshot.StorageSnapshot` of slots ``0 .. used - 1``.

        Call under the owning table's ``lock`` (which the snapshot takes to
        read); ``next_slot`` is the slot the next insert writes. O(1).
        """
        dtypes = {key: spec.dtype for key, spec in self.schema.items()}
        snapshot = StorageSnapshot(self.views, dtypes, lock, next_slot, used,
                                   self.schema.row_bytes, chunk_bytes,
                                   on_close=self._snapshots.remove)
        self._snapshots.append(snapshot)
        return snapshot

    def load_state_dict(self, state: Mapping[str, torch.Tensor], first_slot: int = 0) -> None:
        """Take saved columns ``[used, ...]`` in slot order, written in ring order from
        ``first_slot`` (the oldest row: a compressed column keeps its blocks in the order
        the ring overwrites them)."""
        self.prepare()
        for key, column in self.columns.items():
            saved = numpy_view(state[key].detach().cpu())
            used = saved.shape[0]
            if used == 0:  # a table reset since its last row: nothing to take
                continue
            start = first_slot if used == self.capacity else 0
            column[start:used] = saved[start:]
            if start:
                column[:start] = saved[:start]
