"""Checkpoints: a table set saved to disk while it serves, and restored at start.

Modules, one concept each: ``manifest`` (the versioned JSON description and
its checks), ``statecodec`` (table state as JSON plus raw arrays, no pickle),
``fileio`` (hashed, fsynced files; verified reads), ``directory`` (naming,
locking, atomic commit, pruning), ``writer`` (one checkpoint), ``reader``
(restore rules), ``checkpointer`` (one at a time, shared by concurrent
requests). The consistent snapshot itself is :mod:`replay_server.engine.snapshot`.
No grpc here: the service calls in.

Names are imported on first use (:mod:`replay_proto.exports`): ``check-config``
reads a checkpoint directory without loading the writer, the reader or torch.
"""

from __future__ import annotations

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_server.checkpoint.checkpointer import Checkpointer
    from replay_server.checkpoint.directory import CheckpointDirectory
    from replay_server.checkpoint.fileio import RestoreCancelled
    from replay_server.checkpoint.manifest import FORMAT_VERSION, CorruptCheckpointError, Manifest
    from replay_server.checkpoint.reader import RestoreResult, load_checkpoint, read_manifest
    from replay_server.checkpoint.writer import CheckpointResult, write_checkpoint
else:
    __getattr__, __dir__ = lazy_exports(__name__)
