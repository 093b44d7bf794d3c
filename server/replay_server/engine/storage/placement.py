"""Where a device table's columns go, and whether the machine can hold them there.

A table with ``device = "cuda"`` (or ``"cuda:N"``) keeps its columns in that
device's memory (:mod:`~replay_server.engine.storage.device`). This module
answers the machine questions for it, lazily, so that a server whose tables
all live on the host never initialises CUDA:

* :func:`check_placement` (when the table is made, i.e. at start): is there a
  CUDA device with that index? Asked through ``torch.cuda.device_count()``,
  which consults NVML without initialising CUDA (see
  :func:`replay_feed.accelerator.cuda_present`).
* :func:`check_device_memory` (when the columns are allocated: at start for a
  declared schema, else at the first insert, or at a restore): do the columns
  fit the device's free memory (``torch.cuda.mem_get_info``, which does
  initialise CUDA, for this table only)? Columns are allocated eagerly on a
  device, so each table's check sees what the tables before it took.

**The CPU stand-in (tests only).** Without a GPU, :func:`cpu_stand_in` makes
the very same device-table code run with ``torch.device("cpu")`` as its
device: a ``"cuda"`` table then allocates its columns with the same torch
calls, gathers with ``index_select`` into new tensors, and checks
:attr:`CpuStandIn.devices` and :attr:`CpuStandIn.free_bytes` instead of the
driver (counting the columns it allocated as taken). Nothing is pinned
under it (pinning needs CUDA). Production code
never activates it; tests and benchmarks do, and say so. Not thread-safe to
switch while tables are made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replay_server.engine.memory import format_bytes
from replay_server.errors import ConfigError, InsufficientMemoryError

if TYPE_CHECKING:
    from replay_server.engine.config import TableConfig


@dataclass(slots=True)
class CpuStandIn:
    """What the machine is said to have while the stand-in is active (tests only).

    Attributes:
        devices: how many CUDA devices the machine is said to have.
        free_bytes: free memory the device has before any table allocates.
        allocated: bytes of device columns allocated under the stand-in and still
            alive (they are not free any more, as on a real device).
    """

    devices: int = 1
    free_bytes: int = 1 << 40
    allocated: int = 0

    def allocate(self, owner: object, nbytes: int) -> None:
        """Count ``nbytes`` as taken until ``owner`` is garbage-collected."""
        self.allocated += nbytes
        weakref.finalize(owner, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.allocated -= nbytes


_STAND_IN: CpuStandIn | None = None


@contextmanager
def cpu_stand_in(devices: int = 1, free_bytes: int = 1 << 40) -> Iterator[CpuStandIn]:
    """Within the block, device tables run on the CPU through their device code (tests only)."""
    global _STAND_IN
    previous, _STAND_IN = _STAND_IN, CpuStandIn(devices, free_bytes)
    try:
        yield _STAND_IN
    finally:
        _STAND_IN = previous


def stand_in() -> CpuStandIn | None:
    """The active stand-in, if any."""
    return _STAND_IN


def table_device(config: TableConfig) -> torch.device | None:
    """The torch device ``config``'s columns are allocated on (None: a host table), always
    with its index (``"cuda"`` is ``cuda:0``). Under the stand-in, ``torch.device("cpu")``.
    """
    if not config.on_device:
        return None
    if _STAND_IN is not None:
        return torch.device("cpu")
    return torch.device("cuda", _index(config))  # "cuda" is device 0, as in the checks


def _index(config: TableConfig) -> int:
    device = torch.device(config.device)
    return 0 if device.index is None else device.index


def check_placement(config: TableConfig) -> None:
    """Refuse a device table whose device this machine lacks; no CUDA initialisation.

    Raises:
        ConfigError: naming the table and the device.
    """
    if not config.on_device:
        return
    count = _STAND_IN.devices if _STAND_IN is not None else torch.cuda.device_count()
    index = _index(config)
    if count == 0:
        raise ConfigError(f"table {config.name!r}: device = {config.device!r} but this machine "
                          f"has no CUDA device (torch.cuda.device_count() is 0); use device "
                          f"'cpu' or run the server on a GPU machine")
    if index >= count:
        raise ConfigError(f"table {config.name!r}: device = {config.device!r} but this machine "
                          f"has {count} CUDA device{'s' if count > 1 else ''} (indices 0-"
                          f"{count - 1})")


def device_free_bytes(config: TableConfig) -> int:
    """Free memory of the table's device now (initialises CUDA on a real device)."""
    if _STAND_IN is not None:
        return _STAND_IN.free_bytes - _STAND_IN.allocated
    free, _ = torch.cuda.mem_get_info(_index(config))
    return int(free)


def check_device_memory(config: TableConfig, nbytes: int, purpose: str) -> None:
    """Refuse columns of ``nbytes`` that the device's free memory cannot hold.

    Raises:
        InsufficientMemoryError: naming the table, the device, the bytes and what is free.
    """
    free = device_free_bytes(config)
    if nbytes > free:
        raise InsufficientMemoryError(
            f"table {config.name!r}: {purpose} needs {format_bytes(nbytes)} on device "
            f"{config.device!r}, which has {format_bytes(free)} free; lower the table's "
            f"capacity or its row size")


def pin_staging(device: torch.device) -> bool:
    """Whether host rows bound for ``device`` are staged in pinned memory (a real CUDA device)."""
    return device.type == "cuda"
