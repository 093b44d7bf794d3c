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

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

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
    from replay_server.engine.incarnations import (
        IncarnationSource,
        LocalIncarnations,
        RandomIncarnations,
        check_shard,
        exhausted_message,
    )
    from replay_server.engine.inputs import (
        MAX_BATCH_SIZE,
        batch_size_of,
        columns_of,
        update_values,
    )
    from replay_server.engine.leases import MAX_LEASE_NAME, LeaseRequest
    from replay_server.engine.memory import MemoryLedger, format_bytes
    from replay_server.engine.schema import FieldSpec, Schema
    from replay_server.engine.snapshot import DEFAULT_CHUNK_BYTES, TableSnapshot
    from replay_server.engine.storage.device import host_batch
    from replay_server.engine.storage.placement import table_device
    from replay_server.engine.table import Table
    from replay_server.engine.table_info import TableCounters, TableInfo, field_values
    from replay_server.engine.table_memory import table_bytes
    from replay_server.engine.table_set import TableSet
    from replay_server.engine.table_state import check_saved_config
    from replay_server.engine.takes import retire_rows, retired_ids, settle_taking
    from replay_server.engine.variables import STATE_VERSION as VARIABLES_STATE_VERSION
    from replay_server.engine.variables import Variable, VariableStore, check_name
else:
    __getattr__, __dir__ = lazy_exports(__name__)
