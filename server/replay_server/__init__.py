"""replay_server: the replay engine and, in layers above it, the service and the app.

Layers, each a subpackage, imports pointing one way only::

    engine      tables, storage, ids, samplers, rate limiting   (no grpc)
    checkpoint  checkpoints of an engine's tables on disk        (no grpc)
    service     the gRPC server over the tables
    app         the ``replay-server`` command, settings files, the embedded server

``replay_server.errors`` is the server's one error hierarchy, shared by all
layers. Importing this package loads the engine only: the names below.
"""

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

__all__ = [
    "FieldSpec",
    "ReplayServerError",
    "SampleBatch",
    "SamplerKind",
    "Schema",
    "Table",
    "TableConfig",
    "TableInfo",
    "TableSet",
    "default_table_configs",
]
