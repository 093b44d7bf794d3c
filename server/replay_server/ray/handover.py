"""A removed shard's rows, handed over to the shards that stay (``ReplayCluster.scale`` down).

A shard that a scale down removes has stopped serving (its final checkpoint
written) when this runs, so its tables no longer change; their rows stay
readable in its process (``EmbeddedServer.close`` keeps them). Every table's
live rows are read in insertion order (oldest first: the row numbers
``first_live .. next_id - 1``, their storage positions those modulo the
capacity), with their priorities where the table has them, and inserted
through a sharded client over the shards that stay: each episode's rows go
to one shard (its episode key is a stored column), in the order they were
written, so episodes, slices and n-step windows read on as before, and each
row keeps its priority. The rows get new ids there; ids of the removed shard
name no row any more (a client's update naming one is skipped and counted).

Cost: one read and one insert per :data:`CHUNK_ROWS` rows of each table;
memory bounded by one chunk.

Not thread-safe: one hand-over per shard, after it stopped serving.
"""

from __future__ import annotations

from typing import Any

from replay_proto.keys import unflatten

from replay_server.engine import TableSet

CHUNK_ROWS = 4096
"""Rows read and inserted at a time."""


def hand_over(tables: TableSet, client: Any, chunk_rows: int = CHUNK_ROWS) -> dict[str, int]:
    """Insert every live row of ``tables`` (with its priority) through ``client``: the rows
    moved, by table.

    Raises:
        ReplayError: an insert failed (the error names the shard); the rows of
            earlier chunks are stored there already.
    """
    moved = {}
    for table in tables:
        positions = table.live_positions()
        prioritized = table.config.sampler.traits.priorities
        for start in range(0, positions.size, chunk_rows):
            rows = table.read_rows(positions=positions[start:start + chunk_rows],
                                   priorities=prioritized)
            client.insert(table.config.name, unflatten(rows.columns or {}),
                          priorities=rows.priorities if prioritized else None)
        moved[table.config.name] = int(positions.size)
    return moved

