"""The ``memmap`` backend: a column in a memory-mapped file, for tables larger than RAM.

A column with the ``memmap`` backend (``storage = "memmap"``, or per column
with ``column_storage``) lives in a file under the table's ``storage_dir``,
mapped into the server's address space (``MAP_SHARED``). The kernel's page
cache decides which rows stay in RAM: a table whose files fit in the page
cache samples about as fast as one in RAM, a larger one reads the rows it
samples from disk.

**Space.** A plain column's file is reserved in full when the table's schema
is fixed (``posix_fallocate``), so a disk that cannot hold the table is
reported then, with the bytes needed and free, instead of surfacing later as
a ``SIGBUS`` on a write into a hole the disk has no room for. A compressed
column's file (:mod:`~replay_server.engine.storage.arena`) is sparse and
reserved a segment at a time, before anything of the insert that needs it is
changed. The memory ledger counts none of it (its rows are not RAM the server
must own), and the background page backing of in-RAM columns
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

**Gathers.** When a table's files are larger than this machine's memory (so
most rows sampled are not resident), each column is read in ascending slot
order, so the disk sees forward reads and adjacent rows share pages; the
rows are then put back in batch order. For a table that fits in RAM this
would only add a copy, so it is not done.

Not thread-safe: the owning table serializes access under its lock.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np

from replay_server.engine.memory import format_bytes
from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage.base import ArrayColumn, take_rows
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


def free_bytes(directory: Path) -> int:
    """Bytes the disk under ``directory`` has free for this process."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


class MappedFile:
    """An unlinked scratch file of ``nbytes`` under ``directory``, mapped shared.

    Args:
        directory: an existing, writable directory.
        name: the file's name prefix (table and column).
        nbytes: its size.
        table: the table's name (in errors).
        reserve: reserve all of it on disk now (else it is sparse: :meth:`reserve`
            each range before writing into it).

    Raises:
        InsufficientMemoryError: the disk ran out of space reserving it.
    """

    def __init__(self, directory: Path, name: str, nbytes: int, table: str, *,
                 reserve: bool) -> None:
        self.directory, self.table, self.nbytes = directory, table, nbytes
        fd, path = tempfile.mkstemp(prefix=f"{name}.", suffix=".bin", dir=directory)
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        os.unlink(path)  # the mapping keeps the space; nothing outlives the process
        os.ftruncate(fd, nbytes)
        if reserve:
            self.reserve(0, nbytes)
        self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE) if nbytes else None

    def reserve(self, offset: int, length: int) -> None:
        """Give ``[offset, offset + length)`` blocks on disk (idempotent).

        Raises:
            InsufficientMemoryError: the disk has no room for them.
        """
        if length <= 0:
            return
        try:
            # Asked first: a disk file system allocates a reservation that does not fit
            # until the disk is full, and every other writer on it sees ENOSPC meanwhile.
            # What the file holds already may be part of this range, so only what is
            # certainly new is compared (never a refusal of a range that fits).
            held = os.fstat(self._fd).st_blocks * 512
            if length - held > free_bytes(self.directory):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.posix_fallocate(self._fd, offset, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientMemoryError(
                    f"table {self.table!r}: the disk under {str(self.directory)!r} ran out of "
                    f"space reserving {format_bytes(length)}; free space or lower the "
                    f"capacity") from None
            raise

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The mapping as a numpy array (of zero bytes: an empty one)."""
        if self.map is None:
            return np.zeros(shape, dtype=dtype)
        return np.frombuffer(self.map, dtype=dtype).reshape(shape)


class MemmapColumn(ArrayColumn):
    """``capacity`` rows of ``spec`` in a file under ``directory`` (see the module).

    Args:
        spec: the column's dtype and per-row shape.
        capacity: rows.
        directory: an existing, writable directory with room for the column.
        table, key: names (in the file's name and errors).

    Attributes:
        sorted_gathers: gathers read in slot order (set when the table's files
            are larger than RAM).

    Raises:
        InsufficientMemoryError: the disk cannot hold the column (nothing is left behind).
    """

    kind = "memmap"

    def __init__(self, spec: FieldSpec, capacity: int, directory: Path, table: str,
                 key: str) -> None:
        super().__init__(spec, capacity)
        self.file = MappedFile(directory, f"{table}.{key}", capacity * spec.row_bytes, table,
                               reserve=True)
        self.array = self.file.array(self.dtype, self.shape)
        self.sorted_gathers = False

    @staticmethod
    def ram_bytes(spec: FieldSpec, capacity: int) -> int:
        return 0

    def _take(self, slots: np.ndarray, out: np.ndarray) -> None:
        if not self.sorted_gathers or slots.size < 2:
            take_rows(self.array, slots, out)
            return
        order = np.argsort(slots, kind="stable")
        ordered = np.empty_like(out)
        take_rows(self.array, slots[order], ordered)
        out[order] = ordered


def check_disk(directory: Path, need: int, table: str, what: str) -> None:
    """Refuse files of ``need`` bytes the disk under ``directory`` cannot hold.

    Raises:
        InsufficientMemoryError: naming the bytes needed and free.
    """
    free = free_bytes(directory)
    if need > free:
        raise InsufficientMemoryError(
            f"table {table!r}: storage 'memmap' needs {format_bytes(need)} on disk for "
            f"{what}, and {str(directory)!r} has {format_bytes(free)} free; free space, lower "
            f"the capacity or choose another storage_dir")
