"""replay_server: the replay engine and, in layers above it, the service and the app.

Layers, each a subpackage, imports pointing one way only::

    engine      tables, storage, ids, samplers, rate limiting   (no grpc)
    checkpoint  checkpoints of an engine's tables on disk        (no grpc)
    service     the gRPC server over the tables
    app         the ``replay-server`` command, settings files, the embedded server

``replay_server.errors`` is the server's one error hierarchy, shared by all
layers. The names below come from the engine, loaded on first use: importing
this package loads nothing (the ``replay-server`` command's light commands,
``health`` and ``--version``, never load torch).
"""

from __future__ import annotations

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports
from replay_server import grpc_experiments

# Before anything of the server imports grpc (a no-op in a process that imported it first:
# the server's start-up log then warns): gRPC core experiments known to cancel calls.
grpc_experiments.turn_off()

if TYPE_CHECKING:
    from replay_proto.batch import SampleBatch
    from replay_server.engine import (
        FieldSpec,
        SamplerKind,
        Schema,
        Table,
        TableConfig,
        TableInfo,
        TableSet,
        default_table_configs,
    )
    from replay_server.errors import ReplayServerError
else:
    __getattr__, __dir__ = lazy_exports(__name__)
