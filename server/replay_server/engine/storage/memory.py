"""The ``memory`` backend: a column as one preallocated tensor in RAM (pinned with ``pin_memory``).

Column ``key`` is a tensor of shape ``[capacity, *spec.shape]``; allocation
happens once, up front (pages are touched lazily by the OS as rows arrive,
and made resident ahead of the write cursor by
:mod:`~replay_server.engine.prefault`), so inserts and samples never
allocate storage. On a device table the same backend's columns live in the
device's memory instead (:mod:`~replay_server.engine.storage.device`).

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

import torch

from replay_proto.dtypes import numpy_view
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage.base import ArrayColumn
from replay_server.errors import ConfigError, InsufficientMemoryError


class HostColumn(ArrayColumn):
    """``capacity`` rows of ``spec`` in RAM.

    Args:
        spec: the column's dtype and per-row shape.
        capacity: rows.
        pin_memory: allocate page-locked (pinned) host memory so device copies
            can be asynchronous. Requires an accelerator.

    Raises:
        ConfigError: ``pin_memory`` is requested without an accelerator.
        InsufficientMemoryError: the allocation failed.
    """

    kind = "memory"
    quick_writes = True

    def __init__(self, spec: FieldSpec, capacity: int, *, pin_memory: bool = False) -> None:
        super().__init__(spec, capacity)
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory is true but no CUDA device is available: pinned storage would "
                "not help any copy; set pin_memory to false or 'auto'"
            )
        self._pinned = pin_memory
        try:
            self.tensor = torch.empty(self.shape, dtype=spec.dtype, pin_memory=pin_memory)
        except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as either
            raise InsufficientMemoryError(
                f"cannot allocate {capacity * spec.row_bytes:,} bytes for {capacity:,} rows "
                f"of {spec.describe()}: {exc}") from None
        self.array = numpy_view(self.tensor)

    @property
    def pinned(self) -> bool:
        return self._pinned
