"""Where a table's rows live: one backend per column, and a codec over any of them.

* :mod:`~replay_server.engine.storage.memory`: ``memory`` (the default):
  preallocated tensors in RAM (pinned with ``pin_memory``);
* :mod:`~replay_server.engine.storage.device`: on a device table
  (``device = "cuda"``), ``memory`` columns in device memory, gathered there
  (:mod:`~replay_server.engine.storage.placement`: which device, and whether
  it can hold them);
* :mod:`~replay_server.engine.storage.memmap`: ``memmap``: memory-mapped
  files under ``storage_dir``, for tables larger than RAM;
* :mod:`~replay_server.engine.storage.compressed`: ``compress_keys``: those
  columns' rows lz4-compressed, over RAM or a file
  (:mod:`~replay_server.engine.storage.arena`).

``storage`` names every column's backend, ``column_storage`` overrides it per
column. Every backend is a :class:`~replay_server.engine.storage.base.Column`
and declares its own cost; :func:`make_storage` builds a table's
:class:`~replay_server.engine.storage.columns.ColumnStorage` and
:func:`storage_ram_bytes` adds up what its columns are promised. Nothing
else asks which backend a column has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from replay_server.engine.memory import machine_memory
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.storage.backends import BACKENDS
from replay_server.engine.storage.base import Column
from replay_server.engine.storage.columns import ColumnStorage
from replay_server.engine.storage.compressed import Lz4Column
from replay_server.engine.storage.device import DeviceColumn, DeviceIndex
from replay_server.engine.storage.memmap import (
    MappedFile,
    MemmapColumn,
    check_directory,
    check_disk,
)
from replay_server.engine.storage.memory import HostColumn
from replay_server.engine.storage.placement import (
    check_device_memory,
    check_placement,
    table_device,
)

if TYPE_CHECKING:
    from replay_server.engine.config import TableConfig

__all__ = ["Column", "ColumnStorage", "check_storage", "make_storage"]


def _backend(config: TableConfig, key: str) -> type[Column]:
    """The class that keeps column ``key`` of a table of ``config``."""
    if config.compress_keys and key in config.compress_keys:
        return Lz4Column
    kind = config.backend_of(key)
    if kind == "memmap":
        return MemmapColumn
    registered = BACKENDS[kind]
    if registered.column_class is not None:
        return registered.column_class
    return DeviceColumn if config.on_device else HostColumn


def make_storage(config: TableConfig, schema: Schema,
                 grow: Callable[[int], None] | None = None) -> ColumnStorage:
    """The columns of ``schema`` (as stored) for ``config.capacity`` rows, each in its backend.

    ``grow``: called with the bytes compressed RAM columns have taken in all,
    before they take more (it raises to refuse the insert).

    Raises:
        ConfigError: pinned memory without an accelerator; a missing or
            unwritable ``storage_dir``.
        InsufficientMemoryError: the allocation (or the disk, or the device's
            free memory) cannot hold the table.
    """
    capacity = config.capacity
    backends = {key: _backend(config, key) for key in schema}
    directory = _checked_directory(config, schema, backends)
    device = table_device(config)
    check = None
    on_device = sum(capacity * schema[k].row_bytes for k in schema if backends[k] is DeviceColumn)
    if on_device:
        check = partial(check_device_memory, config, on_device,
                        f"capacity {capacity:,} x {on_device // capacity:,} bytes per row "
                        f"({schema.describe()})")
        check()  # now (at start for a declared schema), and again when it is allocated
    index = DeviceIndex(device) if device is not None else None
    taken: dict[str, int] = {}

    def grown(key: str, nbytes: int) -> None:
        if grow is not None:
            grow(sum({**taken, key: nbytes}.values()))
        taken[key] = nbytes

    columns = {key: _column(config, key, spec, backends[key], directory, index,
                            partial(grown, key))
               for key, spec in schema.items()}
    mapped = [c for c in columns.values() if isinstance(c, MemmapColumn)]
    if sum(c.nbytes for c in mapped) > machine_memory():
        for column in mapped:
            column.sorted_gathers = True
    prefault = [key for key, c in columns.items() if isinstance(c, HostColumn) and not c.pinned]
    return ColumnStorage(schema, capacity, columns, device=device, check=check,
                         prefault=prefault)


def _checked_directory(config: TableConfig, schema: Schema,
                       backends: Mapping[str, type[Column]]) -> Path | None:
    """Where the table's ``memmap`` columns go, checked to be a writable directory whose
    disk holds their plain columns (``None``: the table has none).

    Raises:
        ConfigError: a missing or unwritable ``storage_dir``.
        InsufficientMemoryError: the disk cannot hold the columns.
    """
    on_disk = [key for key in schema if config.backend_of(key) == "memmap"]
    if not on_disk:
        return None
    capacity, name = config.capacity, config.name
    assert config.storage_dir is not None
    directory = check_directory(config.storage_dir, name)
    plain = sum(capacity * schema[k].row_bytes for k in on_disk if backends[k] is MemmapColumn)
    check_disk(directory, plain, name, f"capacity {capacity:,} x "
               f"{plain // capacity if capacity else 0:,} bytes per row")
    return directory


def _column(config: TableConfig, key: str, spec: FieldSpec, backend: type[Column],
            directory: Path | None, index: DeviceIndex | None,
            grow: Callable[[int], None]) -> Column:
    """The column of ``key`` in its ``backend`` (``grow``: a compressed column's promise)."""
    capacity = config.capacity
    if backend is Lz4Column:
        return _compressed(config, key, spec, directory, grow)
    kind = config.backend_of(key)
    make = BACKENDS[kind].column
    if make is not None:  # a backend registered with its own column type
        return make(spec, capacity, config.storage_options[kind])
    if backend is MemmapColumn:
        assert directory is not None
        return MemmapColumn(spec, capacity, directory, config.name, key)
    if backend is DeviceColumn:
        assert index is not None
        return DeviceColumn(spec, capacity, index)
    return HostColumn(spec, capacity, pin_memory=config.pin_memory)


def _compressed(config: TableConfig, key: str, spec: FieldSpec, directory: Path | None,
                grow: Callable[[int], None]) -> Lz4Column:
    """An lz4 column of ``key`` over its backend (a sparse file for ``memmap``, else RAM)."""
    if config.backend_of(key) != "memmap":
        return Lz4Column(spec, config.capacity, grow=grow)
    assert directory is not None
    file = MappedFile(directory, f"{config.name}.{key}",
                      Lz4Column.file_bytes(spec, config.capacity), config.name, reserve=False)
    return Lz4Column(spec, config.capacity, file)


def check_storage(config: TableConfig) -> None:
    """What can be checked of the storage before a schema is known (at start).

    Raises:
        ConfigError: a ``memmap`` table's ``storage_dir`` is missing or not writable; a
            device table's device is missing (asked without initialising CUDA).
    """
    check_placement(config)
    if config.storage_dir is not None:
        check_directory(config.storage_dir, config.name)
