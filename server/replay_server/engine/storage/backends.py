"""The storage backends a config can name, each with its options.

``storage`` names every column's backend and ``column_storage`` overrides it per
column (``replay_server.engine.config``); a backend's options (``memmap``'s
``storage_dir``) are the keys of its :class:`~replay_server.engine.options.LayerSpec`,
taken only where a column uses it. :data:`BACKENDS` is the registry those names
are checked against; :func:`register_backend` adds one whose columns
:func:`~replay_server.engine.storage.make_storage` builds with its
:class:`Backend`'s ``column`` (``memory`` and ``memmap`` are built there).

Thread-safety: registering is meant for import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from replay_server.engine.options import LayerSpec, RegisteredName, Registry
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage.base import Column
from replay_server.engine.storage.memmap import MemmapOptions

__all__ = ["BACKENDS", "Backend", "StorageKind", "register_backend"]


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
    """

    kind: str
    options: type[LayerSpec]
    doc: str
    column: Callable[[FieldSpec, int, Any], Column] | None = None
    column_class: type[Column] | None = None


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
class MemoryOptions(LayerSpec):
    """The ``memory`` backend has no options."""


register_backend(Backend("memory", MemoryOptions, "preallocated tensors in RAM (on a device "
                         "table, in device memory)"))
register_backend(Backend("memmap", MemmapOptions, "memory-mapped files under storage_dir: the "
                         "page cache decides what stays in RAM"))
