"""The replay engine: tables, their storage, ids, samplers, rate limiting and state.

In-process and network-free: no module here imports grpc, the service, the
checkpoint layer or the app. ``Table`` is the orchestrator; everything else
is one concept per module.
"""

from replay_server.engine.config import SamplerKind, TableConfig, default_table_configs
from replay_server.engine.inputs import MAX_BATCH_SIZE
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.table import Table
from replay_server.engine.table_info import TableCounters, TableInfo
from replay_server.engine.table_set import TableSet

__all__ = [
    "MAX_BATCH_SIZE",
    "FieldSpec",
    "SamplerKind",
    "Schema",
    "Table",
    "TableConfig",
    "TableCounters",
    "TableInfo",
    "TableSet",
    "default_table_configs",
]
