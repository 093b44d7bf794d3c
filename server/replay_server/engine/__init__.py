"""The replay engine: tables, their storage, ids, samplers, rate limiting and state.

In-process and network-free: no module here imports grpc, the service, the
checkpoint layer or the app. ``Table`` is the orchestrator and the only door
to a table's rows; everything else is one concept per module.

This module is the engine's front: the layers above it (checkpoint, service,
app, ray) import what they use from here, never from the engine's modules
(``tests/test_layout.py``), so the engine's insides can move without them.

Each name is imported from its module when first used (:mod:`replay_proto.exports`):
reading a config (:mod:`replay_server.engine.config`) loads the torch-free
declarations only, never the tables, storage or samplers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_server.engine.config import (
        SamplerKind,
        TableConfig,
        default_table_configs,
        layer_names,
        table_options,
    )
    from replay_server.engine.id_space import (
        IncarnationSource,
        LocalIncarnations,
        RandomIncarnations,
        check_shard,
        exhausted_message,
    )
    from replay_server.engine.inputs import MAX_BATCH_SIZE, columns_of, update_values
    from replay_server.engine.leases import MAX_LEASE_NAME, LeaseRequest
    from replay_server.engine.memory import MemoryLedger, format_bytes
    from replay_server.engine.schema import FieldSpec, Schema
    from replay_server.engine.snapshot import DEFAULT_CHUNK_BYTES, TableSnapshot
    from replay_server.engine.storage.device import host_batch
    from replay_server.engine.table import Table
    from replay_server.engine.table_info import TableCounters, TableInfo
    from replay_server.engine.table_memory import table_bytes
    from replay_server.engine.table_set import TableSet
    from replay_server.engine.table_state import check_saved_config
    from replay_server.engine.takes import retire_rows, retired_ids, settle_taking
    from replay_server.engine.variables import STATE_VERSION as VARIABLES_STATE_VERSION
    from replay_server.engine.variables import Variable, VariableStore, check_name

_HOMES = {
    "SamplerKind": "replay_server.engine.config",
    "TableConfig": "replay_server.engine.config",
    "default_table_configs": "replay_server.engine.config",
    "layer_names": "replay_server.engine.config",
    "table_options": "replay_server.engine.config",
    "IncarnationSource": "replay_server.engine.id_space",
    "LocalIncarnations": "replay_server.engine.id_space",
    "RandomIncarnations": "replay_server.engine.id_space",
    "check_shard": "replay_server.engine.id_space",
    "exhausted_message": "replay_server.engine.id_space",
    "MAX_BATCH_SIZE": "replay_server.engine.inputs",
    "columns_of": "replay_server.engine.inputs",
    "update_values": "replay_server.engine.inputs",
    "MAX_LEASE_NAME": "replay_server.engine.leases",
    "LeaseRequest": "replay_server.engine.leases",
    "MemoryLedger": "replay_server.engine.memory",
    "format_bytes": "replay_server.engine.memory",
    "FieldSpec": "replay_server.engine.schema",
    "Schema": "replay_server.engine.schema",
    "DEFAULT_CHUNK_BYTES": "replay_server.engine.snapshot",
    "TableSnapshot": "replay_server.engine.snapshot",
    "host_batch": "replay_server.engine.storage.device",
    "Table": "replay_server.engine.table",
    "TableCounters": "replay_server.engine.table_info",
    "TableInfo": "replay_server.engine.table_info",
    "table_bytes": "replay_server.engine.table_memory",
    "TableSet": "replay_server.engine.table_set",
    "check_saved_config": "replay_server.engine.table_state",
    "retire_rows": "replay_server.engine.takes",
    "retired_ids": "replay_server.engine.takes",
    "settle_taking": "replay_server.engine.takes",
    "VARIABLES_STATE_VERSION": "replay_server.engine.variables:STATE_VERSION",
    "Variable": "replay_server.engine.variables",
    "VariableStore": "replay_server.engine.variables",
    "check_name": "replay_server.engine.variables",
}

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_BATCH_SIZE",
    "MAX_LEASE_NAME",
    "VARIABLES_STATE_VERSION",
    "FieldSpec",
    "IncarnationSource",
    "LeaseRequest",
    "LocalIncarnations",
    "MemoryLedger",
    "RandomIncarnations",
    "SamplerKind",
    "Schema",
    "Table",
    "TableConfig",
    "TableCounters",
    "TableInfo",
    "TableSet",
    "TableSnapshot",
    "Variable",
    "VariableStore",
    "check_name",
    "check_saved_config",
    "check_shard",
    "columns_of",
    "default_table_configs",
    "exhausted_message",
    "format_bytes",
    "host_batch",
    "layer_names",
    "retire_rows",
    "retired_ids",
    "settle_taking",
    "table_bytes",
    "table_options",
    "update_values",
]


__getattr__ = lazy_exports(__name__, _HOMES)
