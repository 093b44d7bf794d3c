"""Column-wise row storage in memory-mapped files: tables larger than RAM.

A table with ``storage = "memmap"`` keeps each column in a file under its
``storage_dir``, mapped into the server's address space (``MAP_SHARED``).
Everything else is :class:`~replay_server.engine.storage.memory.ColumnStorage`:
the same writes, gathers, snapshots and ids; only the memory differs. The
kernel's page cache decides which rows stay in RAM: a table whose files fit
in the page cache samples about as fast as one in RAM, a larger one reads
the rows it samples from disk.

**Space.** Each file is reserved in full when the table's schema is fixed
(``posix_fallocate``), so a disk that cannot hold the table is reported
then, with the bytes needed and free, instead of surfacing later as a
``SIGBUS`` on a write into a hole the disk has no room for. The memory
ledger counts only the sampler's state for such a table (its rows are not
RAM the server must own), and the background page backing of in-RAM tables
(:mod:`~replay_server.engine.prefault`) is not used: it would pull the whole
file into RAM.

**Lifetime.** A file is unlinked as soon as it is mapped: its space belongs
to the mapping and is returned when the server exits or the table's storage
is replaced (a restore), however the process ends, so a crash leaves no
stray files behind. The files are scratch space, not a copy to restart
from: checkpoints are what a table restarts from (they stream the rows out
of the mapping once, in pieces, straight into the checkpoint file; see
:mod:`~replay_server.engine.snapshot`), and a restore reads the rows from
the checkpoint straight into the new mapping.

**Gathers.** When the files are larger than this machine's memory (so most
rows sampled are not resident), each column is read in ascending slot order,
so the disk sees forward reads and adjacent rows share pages; the rows are
then put back in batch order. For a table that fits in RAM this would only
add a copy, so it is not done.

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from replay_server.engine.memory import format_bytes, machine_memory
from replay_server.engine.schema import Schema
from replay_server.engine.storage.memory import ColumnStorage
from replay_server.errors import ConfigError, InsufficientMemoryError


def check_directory(directory: str, table: str) -> Path:
    """``directory`` as a path, if it is an existing directory this process may write in.

    Raises:
        ConfigError: it is missing, not a directory, or not writable.
    """
    path = Path(directory)
    where = f"table {table!r}: storage_dir {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{where} does not exist; create it (on a local disk with room for "
                          f"the table) or point storage_dir elsewhere")
    if not path.is_dir():
        raise ConfigError(f"{where} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this process")
    return path


class MemmapStorage(ColumnStorage):
    """Columns for ``capacity`` rows of ``schema`` in files under ``directory`` (see the module).

    Args:
        schema: the columns to allocate.
        capacity: rows per column.
        directory: an existing, writable directory on a disk with room for
            ``capacity * schema.row_bytes`` bytes.
        table: the table's name (in file names and errors).

    Raises:
        ConfigError: ``directory`` is missing, not a directory, or not writable.
        InsufficientMemoryError: the disk cannot hold the table (nothing is left behind).
    """

    kind = "memmap"

    def __init__(self, schema: Schema, capacity: int, directory: str, table: str) -> None:
        self.schema = schema
        self.capacity = capacity
        self.pinned = False
        self.directory = check_directory(directory, table)
        need = capacity * schema.row_bytes
        free = _free_bytes(self.directory)
        if need > free:
            raise InsufficientMemoryError(
                f"table {table!r}: storage 'memmap' needs {format_bytes(need)} on disk for "
                f"capacity {capacity:,} x {schema.row_bytes:,} bytes per row, and "
                f"{str(self.directory)!r} has {format_bytes(free)} free; free space, lower the "
                f"capacity or choose another storage_dir")
        self._maps: list[mmap.mmap] = []
        columns = {key: self._map_column(table, key, (capacity, *spec.shape), spec.dtype)
                   for key, spec in schema.items()}
        self.sorted_gathers = need > machine_memory()
        """Whether gathers read in slot order (the files are larger than RAM)."""
        self._adopt(columns, None)

    def _map_column(self, table: str, key: str, shape: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        fd, name = tempfile.mkstemp(prefix=f"{table}.{key}.", suffix=".bin", dir=self.directory)
        try:
            os.unlink(name)  # the mapping keeps the space; nothing outlives the process
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise InsufficientMemoryError(
                            f"table {table!r}: the disk under {str(self.directory)!r} ran out of "
                            f"space reserving {format_bytes(nbytes)} for column {key!r}; free "
                            f"space or lower the capacity") from None
                    raise
                mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._maps.append(mapped)
                flat = torch.frombuffer(mapped, dtype=dtype, count=nbytes // itemsize)
            else:
                flat = torch.empty(0, dtype=dtype)
            return flat.view(shape)
        finally:
            os.close(fd)

    def _take(self, view: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        if not self.sorted_gathers or rows.size < 2:
            super()._take(view, rows, out)
            return
        order = np.argsort(rows, kind="stable")
        ordered = np.empty_like(out)
        super()._take(view, rows[order], ordered)
        out[order] = ordered


def _free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize
