"""What a table costs in memory, and the ledger that keeps a server's tables within a limit.

A table's memory is fixed by its config and schema: ``capacity`` rows of the
schema's row bytes (allocated when the schema is fixed: by the config at
start, else by the first insert), plus the sampler's per-slot state
(allocated at start): priority sum tree leaves, episode links, slice-start
sets, draw counts. :func:`table_bytes` computes it; a :class:`MemoryLedger`
holds what the tables of one server have been promised and refuses a table
whose memory would take the total past the limit, *before* anything is
allocated, with an error naming the table, the bytes and the limit. (Storage
pages are touched lazily as rows arrive, so without this check an impossible
table is only found when the kernel kills the process.)

The limit defaults to the machine's memory: physical RAM, or the cgroup's
memory limit where one is set (a container's). Thread-safe.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from replay_server.engine.config import SamplerKind, StorageKind, TableConfig
from replay_server.engine.schema import Schema
from replay_server.errors import InsufficientMemoryError

_PRIORITY_TREE = 7
"""Bytes per slot of a SumTree (float32 leaves, float64 nodes per 16-leaf block, minima)."""

_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"),                     # cgroup v2
                  Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))   # cgroup v1


def machine_memory() -> int:
    """Bytes of memory this process may use: physical RAM, or the cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def sampler_slot_bytes(config: TableConfig) -> int:
    """Bytes of sampler (and draw-count) state per slot, allocated when the table is made."""
    index = 4 if config.capacity < 2**31 else 8  # slots as int32 where they fit
    kind = config.sampler
    per_slot = {
        SamplerKind.UNIFORM: 2 * index if config.max_times_sampled else 0,  # drawable set
        SamplerKind.PRIORITIZED: _PRIORITY_TREE,
        SamplerKind.SLICE: 3 * index,  # episode links + slice-start set
        SamplerKind.PRIORITIZED_SLICE: index + _PRIORITY_TREE + 5,  # links, tree, masses
        SamplerKind.FIFO: 0,  # runs of positions: nothing per slot
        SamplerKind.LIFO: 0,
    }[kind]
    per_slot += 26 if config.n_step > 1 else 0  # next-step links and windows (nstep.py)
    per_slot += 16 if config.frame_stack_key else 0  # previous and next step positions
    return per_slot + (4 if config.max_times_sampled else 0)  # uint32 draw counts


def table_bytes(config: TableConfig, schema: Schema | None) -> int:
    """Bytes of RAM a table of ``config`` needs at its capacity (rows of ``schema``, if fixed).

    A ``memmap`` table's rows live in files (the page cache holds what fits),
    so only its sampler state counts; its disk is checked when its files are
    reserved (:mod:`~replay_server.engine.storage.memmap`). A device table's
    rows live in device memory, checked against the device when they are
    allocated (:mod:`~replay_server.engine.storage.placement`).
    """
    row = 0 if (schema is None or config.storage is StorageKind.MEMMAP
                or config.on_device) else stored_row_bytes(config, schema)
    return config.capacity * (row + sampler_slot_bytes(config))


COMPRESSED_ROW_OVERHEAD = 41
"""Bytes a compressed row costs beyond its compressed bytes (a bytes object, a list slot)."""


def stored_row_bytes(config: TableConfig, schema: Schema) -> int:
    """Bytes a row of ``schema`` takes in storage at most: a frame-stacked key keeps one frame
    of its stack; a compressed column is promised lz4's worst case (its raw size, lz4's bound
    and :data:`COMPRESSED_ROW_OVERHEAD`)."""
    row = schema.row_bytes
    for key in config.compress_keys or ():
        spec = schema.get(key)
        if spec is not None:
            row += spec.row_bytes // 255 + 16 + COMPRESSED_ROW_OVERHEAD
    key = config.frame_stack_key
    if key is not None:
        for name in (key, f"next.{key}"):
            spec = schema.get(name)
            if spec is not None and spec.shape:
                row -= spec.row_bytes - spec.row_bytes // spec.shape[0]
    return row


def format_bytes(nbytes: float) -> str:
    """``"1.5 GiB"``: bytes for people."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


class MemoryLedger:
    """Bytes promised to the tables of one server, against ``limit``.

    Each table holds one promise (its sampler state, plus its storage once
    the schema is fixed), replaced whenever it grows; a restore that loads
    a table replaces that table's promise.

    Args:
        limit: bytes all tables together may take (``None``: :func:`machine_memory`).
        what: how the limit is named in errors (e.g. ``"server.table_memory_mb"``).
    """

    def __init__(self, limit: int | None = None, what: str | None = None) -> None:
        self.limit = machine_memory() if limit is None else limit
        self.what = what or "this machine's memory"
        self._lock = threading.Lock()
        self._promised: dict[str, int] = {}

    @property
    def committed(self) -> int:
        """Bytes promised to all tables."""
        with self._lock:
            return sum(self._promised.values())

    def require(self, table: str, nbytes: int, purpose: str) -> None:
        """Promise ``table`` ``nbytes`` in all (replacing its previous promise), or refuse.

        Raises:
            InsufficientMemoryError: the tables' total would pass the limit;
                the previous promise stands.
        """
        with self._lock:
            others = sum(v for k, v in self._promised.items() if k != table)
            if others + nbytes > self.limit:
                held = (f" (the other tables hold {format_bytes(others)})" if others else "")
                raise InsufficientMemoryError(
                    f"table {table!r}: {purpose} needs {format_bytes(nbytes)}, more than "
                    f"{self.what} allows ({format_bytes(self.limit)}){held}; lower the "
                    f"table's capacity or its row size")
            self._promised[table] = nbytes
