"""The storage backends a config can name, each with its options.

``storage`` names every column's backend and ``column_storage`` overrides it per
column (``replay_server.engine.config``); a backend's options (``memmap``'s
``storage_dir``) are the keys of its :class:`~replay_server.engine.options.LayerSpec`,
taken only where a column uses it. :data:`BACKENDS` is the registry those names
are checked against; :func:`register_backend` adds one whose columns
:func:`~replay_server.engine.storage.make_storage` builds with its
:class:`Backend`'s ``column`` (``memory`` and ``memmap`` are built there).

The declarations live here, without torch (a config is read, checked and its
memory promised by ``check-config`` without loading storage); the columns
live in ``engine/storage/``. Besides the backends, the lz4 codec's options
(:class:`CompressionOptions`), which apply over any of them.

Thread-safety: registering is meant for import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from replay_server.engine.options import LayerSpec, RegisteredName, Registry, option
from replay_server.engine.schema import FieldSpec
from replay_server.engine.slot_memory import COMPRESSED_SLOT_BYTES
from replay_server.errors import ConfigError

if TYPE_CHECKING:
    from replay_server.engine.storage.base import Column

__all__ = ["BACKENDS", "Backend", "CompressionOptions", "MemmapOptions", "StorageKind",
           "column_ram_bytes", "register_backend"]


@dataclass(frozen=True)
class Backend:
    """A storage backend as configs name it.

    Attributes:
        kind: the name (``storage = "<kind>"``).
        options: its options' spec (a :class:`LayerSpec` subclass; no fields: none).
        doc: one line for ``check-config`` and the docs.
        column: how a column of ``capacity`` rows of ``spec`` is made with the
            backend's options (``None``: ``make_storage`` builds it: ``memory``,
            ``memmap``); its class's ``ram_bytes`` is what the table promises.
        column_class: the class of the columns ``column`` makes (their
            ``ram_bytes`` is promised at start).
        in_ram: for a backend ``make_storage`` builds (no ``column``): whether its rows
            take RAM (``memory``: yes, unless on a device; ``memmap``: no, they are pages
            of its files).
    """

    kind: str
    options: type[LayerSpec]
    doc: str
    column: Callable[[FieldSpec, int, Any], Column] | None = None
    column_class: type[Column] | None = None
    in_ram: bool = True

    def ram_bytes(self, spec: FieldSpec, capacity: int, *, on_device: bool) -> int:
        """Bytes of RAM a column of ``capacity`` rows of ``spec`` is promised at start."""
        if self.column_class is not None:
            return self.column_class.ram_bytes(spec, capacity)
        return capacity * spec.row_bytes if self.in_ram and not on_device else 0


BACKENDS: Registry[Backend] = Registry("storage")
"""Every storage backend by name, in the order messages list them."""


class StorageKind(RegisteredName):
    """A registered storage backend's name (``StorageKind.MEMORY``, ``StorageKind("memmap")``)."""

    registry: ClassVar[Registry[Any]] = BACKENDS
    _made: ClassVar[dict[str, Any]] = {}


def register_backend(backend: Backend) -> Backend:
    """Make ``backend`` a storage configs can name; a name already taken is refused."""
    if backend.column is not None and backend.column_class is None:
        raise ValueError(f"storage {backend.kind!r}: a backend with a column factory "
                         f"declares its column_class")
    return BACKENDS.register(backend.kind, backend)


@dataclass(frozen=True, kw_only=True)
class MemmapOptions(LayerSpec):
    """The ``memmap`` backend's options."""

    storage_dir: str | None = option(
        None, "the existing directory memmap columns keep their files in", required=True)

    def check(self, where: str, capacity: int) -> None:
        if not isinstance(self.storage_dir, str) or not self.storage_dir:
            raise ConfigError(f"{where}: storage 'memmap' needs storage_dir, the directory "
                              f"its files go in; got {self.storage_dir!r}")


@dataclass(frozen=True, kw_only=True)
class CompressionOptions(LayerSpec):
    """The lz4 codec's options: which columns it stores compressed, over their backend."""

    compress_keys: tuple[str, ...] | None = option(
        None, "columns whose rows are stored lz4-compressed, over their backend; unset: none")

    def check(self, where: str, capacity: int) -> None:
        keys = self.compress_keys
        if keys is None:
            return
        if (not isinstance(keys, (list, tuple)) or not keys
                or not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys)):
            raise ConfigError(f"{where}: compress_keys must be a non-empty list of distinct "
                              f"column names, got {keys!r}")
        self._set("compress_keys", tuple(keys))


@dataclass(frozen=True, kw_only=True)
class MemoryOptions(LayerSpec):
    """The ``memory`` backend has no options."""


register_backend(Backend("memory", MemoryOptions, "preallocated tensors in RAM (on a device "
                         "table, in device memory)"))
register_backend(Backend("memmap", MemmapOptions, "memory-mapped files under storage_dir: the "
                         "page cache decides what stays in RAM", in_ram=False))


def column_ram_bytes(backend: Backend, compressed: bool, spec: FieldSpec, capacity: int, *,
                     on_device: bool) -> int:
    """Bytes of RAM one column is promised at start: a compressed column its per-slot offsets
    (its blocks are promised as they are stored), any other what its backend declares."""
    if compressed:
        return COMPRESSED_SLOT_BYTES * capacity
    return backend.ram_bytes(spec, capacity, on_device=on_device)
