"""replay_server: the replay engine (tables, ids, samplers) and, on top, the service.

The engine modules (everything importable from here) never import grpc.
"""

from replay_proto.batch import SampleBatch
from replay_server.config import SamplerKind, TableConfig, default_table_configs
from replay_server.errors import ReplayServerError
from replay_server.schema import FieldSpec, Schema
from replay_server.table import Table
from replay_server.table_info import TableInfo
from replay_server.tables import Tables

__all__ = [
    "FieldSpec",
    "ReplayServerError",
    "SampleBatch",
    "SamplerKind",
    "Schema",
    "Table",
    "TableConfig",
    "TableInfo",
    "Tables",
    "default_table_configs",
]
