"""Device-resident columns: the ``memory`` backend of a device table (``device = "cuda"``).

What runs where:

* **columns**: one preallocated tensor ``[capacity, *shape]`` per flat key on
  the table's device, checked against the device's free memory when the
  schema is fixed (at start for a declared one;
  :mod:`~replay_server.engine.storage.placement`) and allocated whole, after
  a second check, at the table's first insert or when a restore fills them
  (device memory is taken at allocation, not paged in as rows arrive).
  Columns whose backend cannot live on a device (``memmap``, or compressed:
  lz4 runs on the host) stay on the host and are copied over at gather.
* **inserts** of host rows (from the network or the caller) are copied in
  with one host-to-device copy per column (two where the range wraps), read
  from pinned staging on a CUDA host (a page-locked copy of the rows, from
  torch's caching host allocator, which keeps it alive until the copy has
  run), so the copy is a DMA at full speed. Rows already on the device
  (inserted in process) are copied device to device.
* **sampling** keeps the sampler (sum tree, episode index, remover) on the
  host, as for every table; only the drawn slots travel to the device (one
  small int64 copy per gather, shared by its columns: :class:`DeviceIndex`),
  and every column is gathered there with ``torch.index_select`` into the
  batch: the rows never cross to the host. Without ``out`` the whole batch
  (ids, weights and probabilities too) is on the device. With a host ``out``
  (a shared-memory ring or a unary sample's fallback) the gathered rows are
  copied to it once.
* **priority updates** touch only the host sampler: unchanged.
* **checkpoints** read a column through its slices, which are host copies of
  just those rows, so a snapshot streams the table to host in pieces of
  ``chunk_bytes`` (:mod:`~replay_server.engine.snapshot`), never the whole
  table at once; a restore writes the pieces back the same way.

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

import numpy as np
import torch

from replay_proto.batch import SampleBatch
from replay_proto.dtypes import bits_dtype
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage.base import Column
from replay_server.engine.storage.placement import pin_staging, stand_in
from replay_server.errors import InsufficientMemoryError

STAGING_BYTES = 64 << 20
"""A column's rows up to this size are staged in pinned memory before their device copy;
larger writes (rare: one insert of over 64 MiB per column) copy from pageable memory."""


class DeviceIndex:
    """The slots of one gather on a device, copied there once for all its columns."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = pin_staging(device)
        self._slots: np.ndarray | None = None
        self._index: torch.Tensor | None = None

    def of(self, slots: np.ndarray) -> torch.Tensor:
        """``slots`` as an int64 tensor on the device (the same object: the same copy)."""
        if self._slots is not slots or self._index is None:
            index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
            if self._pin:
                index = index.pin_memory()
            self._index = index.to(self.device, non_blocking=self._pin)
            self._slots = slots
        return self._index


class DeviceColumn(Column):
    """``capacity`` rows of ``spec`` on ``device``, allocated on first use (see the module).

    The column is allocated by :meth:`prepare` (a table's first insert, after
    its storage checked the device's free memory), or when a restore writes
    into it, not when it is made: a server that restores at start makes its
    tables twice (the empty ones, then the restored ones), and device memory,
    unlike host pages, is taken the moment it is allocated.

    Slicing it (``column[a:b]``) gives a host copy of those rows (bfloat16 as
    int16); assigning a slice copies host rows in: how checkpoints read and
    restores fill it, piece by piece.

    Raises:
        InsufficientMemoryError: (when allocating) the device could not hold it.
    """

    kind = "memory"

    def __init__(self, spec: FieldSpec, capacity: int, index: DeviceIndex) -> None:
        super().__init__(spec, capacity)
        self.device = index.device
        self._index = index
        self._pin = pin_staging(index.device)
        self._tensor: torch.Tensor | None = None

    @staticmethod
    def ram_bytes(spec: FieldSpec, capacity: int) -> int:
        return 0  # device memory, checked against the device (placement.py)

    @property
    def allocated(self) -> bool:
        """Whether the column holds device memory yet."""
        return self._tensor is not None

    @property
    def tensor(self) -> torch.Tensor:
        """The column ``[capacity, ...]`` on the device (allocated now if it was not)."""
        self.prepare()
        assert self._tensor is not None
        return self._tensor

    def prepare(self) -> None:
        """Allocate the column if it is not yet.

        Raises:
            InsufficientMemoryError: the device cannot hold it; nothing changed.
        """
        if self._tensor is not None:
            return
        try:
            tensor = torch.empty(self.shape, dtype=self.spec.dtype, device=self.device)
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise InsufficientMemoryError(
                f"cannot allocate {self.capacity * self.row_bytes:,} bytes on {self.device} "
                f"for {self.capacity:,} rows of {self.spec.describe()}: {exc}") from None
        machine = stand_in()
        if machine is not None:
            machine.allocate(self, self.capacity * self.row_bytes)
        self._tensor = tensor

    def _to_device(self, tensor: torch.Tensor, staged: bool = True) -> torch.Tensor:
        """``tensor`` (host) on the device: one copy, from pinned staging on a CUDA host."""
        if tensor.device == self.device:
            return tensor
        if self._pin and staged and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=self._pin)

    def write(self, first_slot: int, encoded: torch.Tensor) -> None:
        """Write host (or device) rows at slots ``first_slot, ...`` (wrapping).

        Cost: a pinned staging copy (CUDA, up to :data:`STAGING_BYTES`) and one
        host-to-device copy (two where it wraps), then a wait for them to land.
        """
        dest = self.tensor
        n = encoded.shape[0]
        src = encoded.detach()
        src = self._to_device(src, staged=src.numel() * src.element_size() <= STAGING_BYTES)
        head = min(n, self.capacity - first_slot)
        dest[first_slot : first_slot + head].copy_(src[:head])
        if head < n:
            dest[: n - head].copy_(src[head:])
        if self._pin:  # the rows are on the device before the insert returns, whatever
            torch.cuda.current_stream(self.device).synchronize()  # stream samples them

    def take(self, slots: np.ndarray, into: torch.Tensor) -> None:
        """Gather on the device into ``into`` (on the device, or a host tensor: one copy back)."""
        index = self._index.of(slots)
        if into.device == self.device:
            torch.index_select(self.tensor, 0, index, out=into)
        else:
            into.copy_(torch.index_select(self.tensor, 0, index))

    @property
    def _bits(self) -> torch.Tensor:
        """The column as numpy-compatible bits (:func:`replay_proto.dtypes.bits_dtype`)."""
        return self.tensor.view(bits_dtype(self.tensor.dtype))

    def __getitem__(self, index: slice) -> np.ndarray:
        return self._bits[index].to("cpu", copy=True).numpy()

    def __setitem__(self, index: slice, rows: np.ndarray) -> None:
        self._bits[index].copy_(torch.from_numpy(np.ascontiguousarray(rows)))


def host_batch(batch: SampleBatch) -> SampleBatch:
    """``batch`` with every tensor on the host: a device table's batch copied over once
    (the network paths' fallback), a host batch as it is (no copy)."""
    tensors = batch.tensors()
    if all(t.device.type == "cpu" for t in tensors):
        return batch
    return batch.with_tensors([t.cpu() for t in tensors])
