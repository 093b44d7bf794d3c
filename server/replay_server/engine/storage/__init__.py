"""Where a table's rows live: the storage kinds, one module each.

* :mod:`~replay_server.engine.storage.memory`: ``storage = "memory"`` (the
  default): preallocated tensors in RAM (pinned with ``pin_memory``).
* :mod:`~replay_server.engine.storage.memmap`: ``storage = "memmap"``:
  memory-mapped files under ``storage_dir``, for tables larger than RAM.
* :mod:`~replay_server.engine.storage.compressed`: ``compress_keys``: those
  columns' rows lz4-compressed in RAM.
* :mod:`~replay_server.engine.storage.framestack`: ``frame_stack_key``: a
  stacked observation kept one frame per step (beside any of the above).
* :mod:`~replay_server.engine.storage.device`: ``device = "cuda"``: the
  columns in device memory, gathered there
  (:mod:`~replay_server.engine.storage.placement`: which device, and whether
  it can hold them).

Every kind is a :class:`~replay_server.engine.storage.memory.ColumnStorage`
(the same writes, gathers and snapshots); the table builds the one its
config names with :func:`make_storage` and never asks which it got.
"""

from __future__ import annotations

from functools import partial

from replay_server.engine.config import StorageKind, TableConfig
from replay_server.engine.schema import Schema
from replay_server.engine.storage.compressed import ROW_OVERHEAD, CompressedStorage
from replay_server.engine.storage.device import DeviceStorage
from replay_server.engine.storage.memmap import MemmapStorage, check_directory
from replay_server.engine.storage.memory import ColumnStorage
from replay_server.engine.storage.placement import (
    check_device_memory,
    check_placement,
    table_device,
)

__all__ = ["ColumnStorage", "CompressedStorage", "DeviceStorage", "MemmapStorage",
           "check_storage", "make_storage", "stored_row_bytes"]


def make_storage(config: TableConfig, schema: Schema) -> ColumnStorage:
    """The storage ``config.storage`` names, for ``config.capacity`` rows of ``schema``.

    Raises:
        ConfigError: pinned memory without an accelerator; a missing or
            unwritable ``storage_dir``.
        InsufficientMemoryError: the allocation (or the disk, or the device's
            free memory) cannot hold the table.
    """
    device = table_device(config)
    if device is not None:
        check = partial(check_device_memory, config, config.capacity * schema.row_bytes,
                        f"capacity {config.capacity:,} x {schema.row_bytes:,} bytes per row "
                        f"({schema.describe()})")
        check()  # now (at start for a declared schema), and again when it is allocated
        return DeviceStorage(schema, config.capacity, device, check)
    if config.storage is StorageKind.MEMMAP:
        assert config.storage_dir is not None
        return MemmapStorage(schema, config.capacity, config.storage_dir, config.name)
    if config.compress_keys:
        return CompressedStorage(schema, config.capacity, config.compress_keys)
    return ColumnStorage(schema, config.capacity, pin_memory=config.pin_memory)


def check_storage(config: TableConfig) -> None:
    """What can be checked of the storage before a schema is known (at start).

    Raises:
        ConfigError: a ``memmap`` table's ``storage_dir`` is missing or not writable; a
            device table's device is missing (asked without initialising CUDA).
    """
    check_placement(config)
    if config.storage is StorageKind.MEMMAP:
        assert config.storage_dir is not None
        check_directory(config.storage_dir, config.name)



def stored_row_bytes(config: TableConfig, schema: Schema) -> int:
    """Bytes a row of ``schema`` takes in storage at most: a frame-stacked key keeps one frame
    of its stack; a compressed column is promised lz4's worst case (its raw size, lz4's bound
    and :data:`~replay_server.engine.storage.compressed.ROW_OVERHEAD`)."""
    row = schema.row_bytes
    for key in config.compress_keys or ():
        spec = schema.get(key)
        if spec is not None:
            row += spec.row_bytes // 255 + 16 + ROW_OVERHEAD
    key = config.frame_stack_key
    if key is not None:
        for name in (key, f"next.{key}"):
            spec = schema.get(name)
            if spec is not None and spec.shape:
                row -= spec.row_bytes - spec.row_bytes // spec.shape[0]
    return row
