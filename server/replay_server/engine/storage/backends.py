"""The storage backends a config can name: declared in :mod:`replay_server.engine.storage_kinds`.

Re-exported here, beside the columns, for the plug-ins that register one
(:func:`register_backend` with a :class:`Backend` whose ``column`` makes their
columns).
"""

from __future__ import annotations

from replay_server.engine.storage_kinds import BACKENDS, Backend, StorageKind, register_backend

__all__ = ["BACKENDS", "Backend", "StorageKind", "register_backend"]
