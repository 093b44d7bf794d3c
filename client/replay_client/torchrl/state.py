"""A buffer's contents saved and restored: ``state_dict``/``load_state_dict``, ``dumps``/``loads``;
and what it holds, counted (``stats``).

TorchRL checkpoints a buffer with ``rb.state_dict()`` (a dict of tensors) or
``rb.dumps(path)`` (a directory). Here the rows live on the server, so both
export the table's rows through ``ReplayClient.read`` and import them through
inserts into the table, emptied first (its schema forgotten, as
``rb.empty()``):

* rows are exported oldest first (ordered by id), with their priorities on a
  prioritized table, and the table's ``alpha``/``beta`` in force; on import
  they are inserted oldest first with those priorities, and the exponents
  set. A table that was never full gets its rows back at the same storage
  positions; one that had wrapped gets them from position 0 on (the oldest
  first), so the next insert overwrites the oldest row in both cases.
* ``dumps(path)`` streams: it reads the ids of all rows (8 bytes each) to
  order them, then reads and writes :data:`CHUNK_ROWS` rows at a time, one
  file per chunk (``torch.save`` of tensors, loadable with
  ``weights_only=True``), and ``loads`` inserts one chunk at a time, so
  neither side holds more than a chunk of rows. ``state_dict`` holds every
  row in memory, as TorchRL's does.

**The sample stream.** TorchRL's buffers save their sampler's random
state, so a buffer restored from a state continues the sample stream the
saved buffer drew after it was saved. Draws happen on the server here, and a
generator's state does not travel, so saving seeds instead: ``state_dict``
and ``dumps`` set a fresh seed on the table (:func:`next_seed`) and keep it
(``"_rng"``), and an import sets it again after its rows are in. Both
buffers then draw the same batches from the same rows, as TorchRL's tests
``test_rng_state_dict`` and ``test_replay_buffer_prefetch_*_roundtrip``
expect. What does not come back: the exact stream for a table that had
wrapped (its rows come back at other positions, so the same draws pick
other rows), and batches a ``for batch in rb`` stream prefetched before the
save (drawn with the old seed).

Ids are not restored: imported rows get fresh ids (ids are never issued
twice), so ids kept from before the import are stale. Storage positions
(``"index"``) are restored wherever rows are.

These functions are :class:`~replay_client.torchrl.buffer.RemoteReplayBuffer`'s
methods; they take the buffer first. Thread-safety: as the client; writers
of the same table during an export or import interleave with it.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replay_client.errors import InvalidArgumentError


def stats(buffer: Any) -> dict[str, Any]:
    """TorchRL's ``rb.stats()``: ``size``, ``write_count``, ``capacity``, ``utilization``,
    ``prefetch_queue_size`` (0: iteration prefetches in its stream, not in the buffer) and
    ``initialized``, as plain values (JSON-serializable). One ``info`` call; changes nothing."""
    info = buffer.table_info(fresh=True)
    return {"size": info.size, "write_count": buffer.write_count, "capacity": info.capacity,
            "utilization": info.size / info.capacity, "prefetch_queue_size": 0,
            "initialized": buffer.initialized}

FORMAT = "replay-server.torchrl-buffer/1"
"""What a saved buffer says it is (``state_dict()["format"]``, ``meta.json``)."""

CHUNK_ROWS = 65_536
"""Rows per file of ``dumps`` (and per read and insert of an export or import)."""


SEED_BITS = 63
"""Seeds set on save are below ``2**63`` (an int64, loadable with ``weights_only=True``)."""


def next_seed(buffer: Any) -> int:
    """A fresh seed for the table's generator, set on it now (see the module docstring).

    Derived from the buffer's ``generator`` seed and a count of saves when it
    was given one (a seeded run saves the same seeds again), else random.
    """
    base = getattr(buffer, "_seed", None)
    if base is None:
        seed = secrets.randbits(SEED_BITS)
    else:
        buffer._saves = getattr(buffer, "_saves", 0) + 1
        state = np.random.SeedSequence([base, buffer._saves]).generate_state(2, np.uint64)
        seed = int(state[0]) >> (64 - SEED_BITS)
    buffer.replay_client.set_sampling(buffer.table, seed=seed)
    return seed


def _meta(buffer: Any, rows: int, chunks: int) -> dict[str, Any]:
    info = buffer.table_info(fresh=True)
    prioritized = info.capabilities.priorities
    episodes = buffer._episodes
    return {"format": FORMAT, "table": buffer.table, "rows": rows, "chunks": chunks,
            "_batch_size": buffer.batch_size,  # where TorchRL's state dicts keep it
            "capacity": info.capacity, "prioritized": prioritized,
            "exponents": [info.alpha, info.beta] if prioritized else None,
            "episode_added": bool(episodes is not None and episodes.added),
            "kind": buffer._kind.name, "_rng": next_seed(buffer)}


def _order(buffer: Any) -> np.ndarray:
    """Storage positions of every row, oldest first."""
    size = len(buffer)
    positions = np.arange(size, dtype=np.int64)
    if size == 0:
        return positions
    ids = buffer.replay_client.read(buffer.table, positions=positions, columns=False).ids
    return positions[np.argsort(ids.numpy(), kind="stable")]


def _export(buffer: Any, positions: np.ndarray) -> dict[str, Any]:
    got = buffer.replay_client.read(buffer.table, positions=positions,
                             priorities=buffer.table_info().capabilities.priorities)
    return {"columns": got.columns, "priorities": got.priorities}


def _import(buffer: Any, part: dict[str, Any]) -> None:
    columns = part["columns"]
    if columns:
        buffer.replay_client.insert(buffer.table, columns, priorities=part.get("priorities"))


def _end_import(buffer: Any, meta: dict[str, Any]) -> None:
    """The saved buffer's seed set on the table, once its rows are in (a state saved
    before seeds were kept has none: the table's generator goes on)."""
    seed = meta.get("_rng")
    if seed is not None:
        buffer.replay_client.set_sampling(buffer.table, seed=int(seed))


def _begin_import(buffer: Any, meta: dict[str, Any]) -> None:
    if meta.get("format") != FORMAT:
        raise InvalidArgumentError(f"not a saved RemoteReplayBuffer: format "
                                   f"{meta.get('format')!r}, expected {FORMAT!r}")
    info = buffer.table_info()
    if meta["rows"] > info.capacity:
        raise InvalidArgumentError(f"the saved buffer holds {meta['rows']} rows, more than "
                                   f"table {info.name!r}'s capacity of {info.capacity}")
    buffer.empty()
    exponents = meta.get("exponents")
    if exponents and info.capabilities.priorities:
        buffer.replay_client.set_sampling(buffer.table, alpha=exponents[0], beta=exponents[1])
    if buffer._episodes is not None:
        buffer._episodes.added = bool(meta.get("episode_added"))
    buffer._kind.name = meta.get("kind")


def state_dict(buffer: Any) -> dict[str, Any]:
    """Every row (oldest first), their priorities and the table's exponents, as tensors
    and plain values (``torch.save``-able, loadable with ``weights_only=True``)."""
    order = _order(buffer)
    return {**_meta(buffer, order.size, 1), **_export(buffer, order)}


def load_state_dict(buffer: Any, state: dict[str, Any]) -> None:
    """Replace the table's rows with those of a :func:`state_dict` (the schema too)."""
    _begin_import(buffer, state)
    columns = state["columns"]
    rows = next(iter(columns.values())).shape[0] if columns else 0
    priorities = state.get("priorities")
    for start in range(0, rows, CHUNK_ROWS):
        part = {k: v[start:start + CHUNK_ROWS] for k, v in columns.items()}
        _import(buffer, {"columns": part, "priorities": None if priorities is None
                         else priorities[start:start + CHUNK_ROWS]})
    _end_import(buffer, state)


def dumps(buffer: Any, path: str | Path) -> None:
    """Save the buffer's rows under directory ``path``, a chunk of rows per file."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    order = _order(buffer)
    chunks = 0
    for start in range(0, order.size, CHUNK_ROWS):
        torch.save(_export(buffer, order[start:start + CHUNK_ROWS]),
                   root / f"rows-{chunks:06d}.pt")
        chunks += 1
    (root / "meta.json").write_text(json.dumps(_meta(buffer, order.size, chunks), indent=1))


def loads(buffer: Any, path: str | Path) -> None:
    """Replace the table's rows with those saved by :func:`dumps` under ``path``."""
    root = Path(path)
    meta_path = root / "meta.json"
    if not meta_path.exists():
        raise InvalidArgumentError(f"{root} holds no saved RemoteReplayBuffer (no meta.json)")
    meta = json.loads(meta_path.read_text())
    _begin_import(buffer, meta)
    for chunk in range(meta["chunks"]):
        _import(buffer, torch.load(root / f"rows-{chunk:06d}.pt", weights_only=True))
    _end_import(buffer, meta)
