"""What a table costs in memory, and the ledger that keeps a server's tables within a limit.

A table's memory is fixed by its config and schema: ``capacity`` rows as its
storage keeps them (allocated when the schema is fixed: by the config at
start, else by the first insert), plus the per-slot state its sampler,
remover and readers declare (allocated at start): priority sum tree leaves,
episode links, slice-start sets, draw counts.
:func:`~replay_server.engine.table_memory.table_bytes` adds them up; a :class:`MemoryLedger`
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

from replay_server.errors import InsufficientMemoryError

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
