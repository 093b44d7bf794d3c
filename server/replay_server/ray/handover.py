"""A removed shard's rows, handed over to the shards that stay (``ReplayCluster.scale`` down).

A shard that a scale down removes has stopped serving (its final checkpoint
written) when this runs, so its tables no longer change; their rows stay
readable in its process (``EmbeddedServer.close`` keeps them). Every table's
live rows are read in insertion order (oldest first: the row numbers
``first_live .. next_id - 1``, their storage positions those modulo the
capacity), with their priorities where the table has them, and inserted
into the shards that stay, placed as a sharded client places them
(:mod:`replay_client.sharded.placement`: each episode's rows to the shard its
id hashes to, other rows a chunk per shard in turn), in the order they were
written, so episodes, slices and n-step windows read on as before, and each
row keeps its priority. The rows get new ids there; ids of the removed shard
name no row any more (a client's update naming one is skipped and counted).

**A hand-over that fails part-way** (a staying shard refuses a chunk, or stops
answering) leaves every row stored once: :func:`hand_over` inserts into each
staying shard on its own (one insert per shard per chunk: a refused insert
stores nothing), records per table the storage positions of the rows each
acknowledged, and :class:`HandOverError` carries them. The removed shard then
serves again holding only the rows that did not move (:func:`keep_unmoved`):
it gives up the moved ones, rather than the shards that stay giving them back
(a table deletes rows only where rows leave when sampled). A scale asked
again moves the rest. What cannot be known: the rows of an insert that got no
answer (its shard's process died in the call) may be stored there; they are
counted as not moved, so they are kept here too.

Cost: one read per :data:`CHUNK_ROWS` rows of each table and one insert per
staying shard it places rows on; memory bounded by one chunk.
:func:`keep_unmoved` holds a second copy of the rows it keeps while it
rebuilds a table.

Not thread-safe: one hand-over per shard, after it stopped serving.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replay_client import ReplayError, by_episode
from replay_proto.keys import unflatten

from replay_server.checkpoint.incarnation import INCARNATION_NAME
from replay_server.engine import TableSet
from replay_server.errors import ReplayServerError

CHUNK_ROWS = 4096
"""Rows read at a time."""


class HandOverError(ReplayServerError):
    """An insert into a shard that stays failed part-way through a hand-over.

    Attributes:
        moved: by table, the storage positions of the rows the shards that stay
            acknowledged (a table not reached: none).
        shard: the index of the shard whose insert failed.
    """

    def __init__(self, message: str, moved: dict[str, np.ndarray], shard: int) -> None:
        super().__init__(message)
        self.moved = moved
        self.shard = shard


def hand_over(tables: TableSet, clients: Sequence[Any],
              chunk_rows: int = CHUNK_ROWS) -> dict[str, int]:
    """Insert every live row of ``tables`` (with its priority) into the shards that stay
    (``clients``: one single-server client each, in shard index order): the rows moved, by
    table.

    Raises:
        HandOverError: an insert failed (the message names the shard, the table and why;
            ``moved`` says which rows the shards acknowledged before).
    """
    moved: dict[str, list[np.ndarray]] = {table.config.name: [] for table in tables}
    turn = 0
    for table in tables:
        name, positions = table.config.name, table.live_positions()
        prioritized = table.config.sampler.traits.priorities
        for start in range(0, positions.size, chunk_rows):
            chunk = positions[start:start + chunk_rows]
            read = table.read_rows(positions=chunk, priorities=prioritized)
            columns = read.columns or {}
            for shard, rows in _placed(columns.get(table.config.episode_key or ""),
                                       chunk.size, len(clients), turn).items():
                picked = torch.from_numpy(rows)
                try:  # a refused insert stores nothing (one that got no answer: see above)
                    clients[shard].insert(name, unflatten({k: v[picked]
                                                           for k, v in columns.items()}),
                                          priorities=(read.priorities[rows]
                                                      if read.priorities is not None
                                                      else None))
                except ReplayError as exc:
                    done = {n: _joined(p) for n, p in moved.items()}
                    raise HandOverError(
                        f"shard {shard} refused rows of table {name!r} "
                        f"({sum(p.size for p in done.values())} rows had moved): "
                        f"{type(exc).__name__}: {exc}", done, shard) from exc
                moved[name].append(chunk[rows])
            turn += 1
    return {name: int(_joined(parts).size) for name, parts in moved.items()}


def _placed(episodes: torch.Tensor | None, count: int, shards: int,
            turn: int) -> dict[int, np.ndarray]:
    """Row indices per staying shard: by episode where the rows carry one (as a sharded
    client places an insert), else every row to shard ``turn % shards``."""
    if episodes is not None:
        return by_episode(episodes.numpy().reshape(-1).astype(np.int64), range(shards))
    return {turn % shards: np.arange(count)}


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def keep_unmoved(source: TableSet, target: TableSet, moved: Mapping[str, np.ndarray],
                 chunk_rows: int = CHUNK_ROWS) -> dict[str, int]:
    """Make each table of ``target`` hold the rows of ``source``'s table of that name that
    did not move (all but those at the positions ``moved[name]``), in order, with their
    priorities: the rows each now holds, by table.

    ``target`` is a new server's tables: restored from the final checkpoint that ``source``
    wrote (a table none of whose rows moved is kept as restored, its ids unchanged), or empty
    (no checkpoint folder). A table that gave rows up is reset and its other rows inserted
    again (new ids; ids are never reused). Holds the kept rows of one table twice meanwhile.
    """
    left = {}
    for table in source:
        name = table.config.name
        positions = table.live_positions()
        gone = np.asarray(moved.get(name, ()), dtype=np.int64)
        kept = positions[~np.isin(positions, gone)]
        target_table = target[name]
        left[name] = int(kept.size)
        if kept.size == positions.size and target_table.size == positions.size:
            continue  # restored as it was
        prioritized = table.config.sampler.traits.priorities
        chunks = [table.read_rows(positions=kept[start:start + chunk_rows],
                                  priorities=prioritized)
                  for start in range(0, kept.size, chunk_rows)]
        target_table.reset()
        for rows in chunks:
            target_table.insert(unflatten(rows.columns or {}),
                                priorities=rows.priorities if prioritized else None)
    return left


def retire_folder(folder: str | Path) -> str:
    """Set a removed shard's checkpoint folder aside (``<folder>.retired-<time>-<pid>``) and
    leave ``folder`` holding only its id counter (the ``INCARNATION`` file): a shard of that
    index started by a later scale begins empty, and its ids carry incarnations above the
    removed shard's, so an id the removed shard issued (a learner's stale update) never
    names one of its rows. Returns the retired folder's path."""
    retired = f"{folder}.retired-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.rename(folder, retired)
    counter = Path(retired) / INCARNATION_NAME
    if counter.exists():
        os.makedirs(folder)
        shutil.copy2(counter, Path(folder) / INCARNATION_NAME)
    return retired


def unretire_folder(retired: str | Path, folder: str | Path) -> None:
    """Put a folder :func:`retire_folder` set aside back in place (a failed scale down)."""
    (Path(folder) / INCARNATION_NAME).unlink(missing_ok=True)
    if os.path.isdir(folder):
        os.rmdir(folder)  # the counter's folder only: anything else in it is an error
    os.rename(retired, folder)


def counted(rows: Mapping[str, int]) -> str:
    """Rows by table, as an error message says them."""
    return ", ".join(f"{table!r}: {n}" for table, n in rows.items()) or "none"


def kept_message(index: int, result: Mapping[str, Any]) -> str:
    """What a removed shard whose hand-over failed part-way did (it serves again)."""
    return (f"shard {index} could not hand its rows over ({result['failure']}); the rows it "
            f"had moved ({counted(result['moved'])}) stay where they went and it serves "
            f"again with the others ({counted(result['left'])}): every row is stored once")


def unanswered_message(index: int, exc: BaseException) -> str:
    """A removed shard that did not say how its hand-over went (its actor died or hung)."""
    return (f"shard {index} did not say how its hand-over ended ({type(exc).__name__}: "
            f"{exc}); its final checkpoint holds every row it had, so if it had moved rows "
            f"before, a restart of it stores those twice")
