"""Device-resident row storage: a table's columns in GPU memory (``device = "cuda"``).

What runs where:

* **columns**: one preallocated tensor ``[capacity, *shape]`` per flat key on
  the table's device, checked against the device's free memory when the
  schema is fixed (at start for a declared one;
  :mod:`~replay_server.engine.storage.placement`) and allocated whole, after
  a second check, at the table's first insert or when a restore fills them
  (device memory is taken at allocation, not paged in as rows arrive).
* **inserts** of host rows (from the network or the caller) are copied in
  with one host-to-device copy per column (two where the range wraps), read
  from pinned staging on a CUDA host (a page-locked copy of the rows, from
  torch's caching host allocator, which keeps it alive until the copy has
  run), so the copy is a DMA at full speed. Rows already on the device
  (inserted in process) are copied device to device.
* **sampling** keeps the sampler (sum tree, episode index, retirement) on the
  host, as for every table; only the drawn slots travel to the device (one
  small int64 copy), and every column is gathered there with
  ``torch.index_select`` into the batch: the rows never cross to the host.
  Without ``out`` the whole batch (ids, weights and probabilities too) is
  on the device. With a host ``out`` (a shared-memory ring or a unary
  sample's fallback) the gathered rows are copied to it once.
* **priority updates** touch only the host sampler: unchanged.
* **checkpoints** read the columns through :class:`DeviceColumn`, whose slices
  are host copies of just those rows, so a snapshot streams the table to host
  in pieces of ``chunk_bytes`` (:mod:`~replay_server.engine.snapshot`), never
  the whole table at once; a restore writes the pieces back the same way.

Everything is written against torch operations that run on any device, so
the very same class runs on the CPU under the test stand-in
(:func:`~replay_server.engine.storage.placement.cpu_stand_in`), where the
engine tests compare it bit for bit with a host table.

Not thread-safe: the owning table serializes access under its lock. Copies
and gathers are issued on the calling thread's current stream (the default
stream, for the server's threads); an insert waits for its copies to land,
so a gather on any stream sees its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_server.engine.schema import Schema
from replay_server.engine.snapshot import StorageSnapshot
from replay_server.engine.storage.memory import ColumnStorage
from replay_server.engine.storage.placement import pin_staging, stand_in
from replay_server.errors import InsufficientMemoryError

STAGING_BYTES = 64 << 20
"""A column's rows up to this size are staged in pinned memory before their device copy;
larger writes (rare: one insert of over 64 MiB per column) copy from pageable memory."""


class DeviceColumn:
    """One device column as a checkpoint sees it: sliced like a numpy array, through host copies.

    ``column[a:b]`` is a new host array of rows ``a .. b - 1`` (bfloat16 as
    int16); ``column[a:b] = rows`` copies host rows into them. Only the rows
    sliced ever cross to the host. Its shape and dtype are known before the
    storage's columns are allocated; slicing allocates them.
    """

    def __init__(self, storage: DeviceStorage, key: str) -> None:
        spec = storage.schema[key]
        self._storage = storage
        self._key = key
        self.shape = (storage.capacity, *spec.shape)
        bits = torch.int16 if spec.dtype == torch.bfloat16 else spec.dtype
        self.dtype = torch.empty(0, dtype=bits).numpy().dtype
        self.itemsize = self.dtype.itemsize
        self.ndim = len(self.shape)

    @property
    def _bits(self) -> torch.Tensor:
        tensor = self._storage.columns[self._key]
        return tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor

    def __getitem__(self, index: slice) -> np.ndarray:
        return self._bits[index].to("cpu", copy=True).numpy()

    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        self._bits[index].copy_(torch.from_numpy(np.ascontiguousarray(rows)))


class DeviceStorage(ColumnStorage):
    """Columns for ``capacity`` rows of ``schema`` on ``device``, allocated on first use.

    The columns are allocated by :meth:`prepare` (a table's first insert), or
    when a restore writes into them, not when the storage is made: a server
    that restores at start makes its tables twice (the empty ones, then the
    restored ones), and device memory, unlike host pages, is taken the moment
    it is allocated. ``check`` (if given) runs right before the allocation (the
    device's free memory now; it raises to refuse).

    Args:
        schema: the columns to allocate.
        capacity: rows per column.
        device: where they live (``torch.device("cpu")`` under the test stand-in).
        check: called before allocating.

    Raises:
        InsufficientMemoryError: (when allocating) the device could not hold them.
    """

    kind = "device"

    def __init__(self, schema: Schema, capacity: int, device: torch.device,
                 check: Callable[[], None] | None = None) -> None:
        self.schema = schema
        self.capacity = capacity
        self.device = device
        self.pinned = False
        self._pin = pin_staging(device)
        self._check = check
        self._columns: dict[str, torch.Tensor] | None = None
        self._views: dict[str, Any] = {key: DeviceColumn(self, key) for key in schema}
        self._snapshots: list[StorageSnapshot] = []
        self._prefaulter = None

    @property
    def columns(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The columns ``[capacity, ...]`` on the device (allocated now if they were not)."""
        self.prepare()
        assert self._columns is not None
        return self._columns

    @property
    def allocated(self) -> bool:
        """Whether the columns hold device memory yet."""
        return self._columns is not None

    def prepare(self) -> None:
        """Allocate the columns if they are not yet (checked against the device first).

        Raises:
            InsufficientMemoryError: the device cannot hold them; nothing changed.
        """
        if self._columns is not None:
            return
        if self._check is not None:
            self._check()
        schema, capacity, device = self.schema, self.capacity, self.device
        try:
            columns = {key: torch.empty((capacity, *spec.shape), dtype=spec.dtype,
                                        device=device) for key, spec in schema.items()}
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise InsufficientMemoryError(
                f"cannot allocate {capacity * schema.row_bytes:,} bytes on {device} for "
                f"{capacity:,} rows of {schema.describe()}: {exc}") from None
        machine = stand_in()
        if machine is not None:
            machine.allocate(self, capacity * schema.row_bytes)
        self._columns = columns

    def _to_device(self, tensor: torch.Tensor, staged: bool = True) -> torch.Tensor:
        """``tensor`` (host) on the device: one copy, from pinned staging on a CUDA host."""
        if tensor.device == self.device:
            return tensor
        if self._pin and staged and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=self._pin)

    def write(self, first_slot: int, columns: Mapping[str, torch.Tensor]) -> None:
        """Write ``n`` host rows at slots ``first_slot, ...`` (wrapping).

        Cost: a pinned staging copy (CUDA, up to :data:`STAGING_BYTES` per
        column) and one host-to-device copy per column (two where it wraps),
        then a wait for them to land. The table calls :meth:`prepare` first,
        so the columns exist.
        """
        n = next(iter(columns.values())).shape[0]
        for snapshot in self._snapshots:
            snapshot.before_write(first_slot, n)
        head = min(n, self.capacity - first_slot)
        for key, dest in self.columns.items():
            src = columns[key].detach()
            src = self._to_device(src, staged=src.numel() * src.element_size() <= STAGING_BYTES)
            dest[first_slot : first_slot + head].copy_(src[:head])
            if head < n:
                dest[: n - head].copy_(src[head:])
        if self._pin:  # the rows are on the device before the insert returns, whatever
            torch.cuda.current_stream(self.device).synchronize()  # stream samples them

    def gather(
        self, slots: np.ndarray, out: Mapping[str, torch.Tensor] | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Gather the rows at ``slots`` (any shape ``S``) on the device into ``[*S, ...]`` tensors.

        ``out`` tensors on the device receive the rows directly; host ones
        (the fallback for a caller that needs host memory) receive one copy
        of the gathered rows.

        Cost: one small copy of the slots to the device, one ``index_select``
        per column there, plus one device-to-host copy per column into a host ``out``.
        """
        flat = slots.reshape(-1)
        index = self._to_device(torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64)))
        result = {}
        for key in self.columns if keys is None else keys:
            col = self.columns[key]
            shape = (flat.shape[0], *col.shape[1:])
            dest = None if out is None else out.get(key)
            if dest is not None and dest.device == col.device:
                torch.index_select(col, 0, index, out=dest.view(shape))
            elif dest is not None:  # a host destination: the one copy back
                dest.view(shape).copy_(torch.index_select(col, 0, index))
            else:
                dest = torch.index_select(col, 0, index).reshape(*slots.shape, *col.shape[1:])
            result[key] = dest
        return result

    def place(self, batch: SampleBatch, out: Mapping[str, torch.Tensor] | None) -> SampleBatch:
        """Without ``out``, the batch's ids, weights and probabilities join its rows on the device."""
        if out is not None:
            return batch
        ids, weights, probabilities = (self._to_device(t) for t in batch.extras)
        return SampleBatch.from_columns(batch.columns, ids, weights, probabilities, batch.mass)

    def load_views(self) -> dict[str, Any]:
        """The columns as :class:`DeviceColumn` s: a checkpoint's rows are written in pieces."""
        return self.views

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, col in self.columns.items():
            saved = state[key].detach()
            col[: saved.shape[0]].copy_(saved)


def host_batch(batch: SampleBatch) -> SampleBatch:
    """``batch`` with every tensor on the host: a device table's batch copied over once
    (the network paths' fallback), a host batch as it is (no copy)."""
    tensors = batch.tensors()
    if all(t.device.type == "cpu" for t in tensors):
        return batch
    return batch.with_tensors([t.cpu() for t in tensors])
