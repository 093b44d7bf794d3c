"""Checkpoint files: written once with a running sha256 and fsynced; read back verified.

Bytes go straight between numpy arrays and the file descriptor (no
intermediate copies); hashing and the system calls release the GIL, so a
checkpoint being written costs request threads little beyond CPU time.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from pathlib import Path

import numpy as np

from replay_server.checkpoint.manifest import CorruptCheckpointError, FileEntry

READ_CHUNK = 64 << 20
"""Bytes read per system call when loading."""

SYNC_EVERY = 32 << 20
"""Bytes written between flushes to disk: writeback goes on steadily instead of piling
up gigabytes of dirty pages that stall the whole machine when they are flushed."""


class RestoreCancelled(Exception):
    """A restore was cancelled (the server was told to stop while loading)."""


MISSING = {errno.ENOENT, errno.ENOTDIR, errno.ELOOP}
"""Errors opening a checkpoint file that mean it is not there: damage."""


def open_regular(path: Path, name: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (``name``: how messages call it).

    Opened without blocking, so a FIFO or a device in a file's place cannot
    hang the restore (opening a FIFO waits for a writer), then refused.

    Raises:
        CorruptCheckpointError: the file is missing, or is not a regular file.
        OSError: it could not be opened for another reason (no descriptors left,
            permissions): not damage, the caller decides.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in MISSING:
            raise CorruptCheckpointError(f"cannot open {name}: {exc.strerror}") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(
                f"{name} is not a regular file (a {_file_kind(mode)}): refused unread")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, name: str, limit: int) -> bytes:
    """The whole regular file at ``path``, at most ``limit`` bytes (see :func:`open_regular`).

    Raises:
        CorruptCheckpointError: missing, not a regular file, or larger than ``limit``.
        OSError: see :func:`open_regular`.
    """
    fd = open_regular(path, name)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpointError(f"{name} is {size} bytes, more than the {limit} a "
                                         f"checkpoint writes")
        with open(fd, "rb", closefd=False) as file:
            return file.read(limit + 1)
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "special file"


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any shape, zero-size included)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class HashedWriter:
    """A new file, written sequentially, with its size and sha256 kept as it goes.

    Args:
        root: the checkpoint directory being written.
        name: path relative to ``root`` (recorded in the manifest as is).
    """

    def __init__(self, root: Path, name: str) -> None:
        self.path = root / name
        self.name = name
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # owner only
        self._hash = hashlib.sha256()
        self._size = 0
        self._synced = 0

    def write(self, array: np.ndarray) -> None:
        data = as_bytes(array)
        self._hash.update(data)
        view = memoryview(data)
        while view.nbytes:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += data.size
        if self._size - self._synced >= SYNC_EVERY:
            os.fdatasync(self._fd)
            # Written and on disk: the page cache need not keep it.
            os.posix_fadvise(self._fd, self._synced, self._size - self._synced,
                             os.POSIX_FADV_DONTNEED)
            self._synced = self._size

    def finish(self) -> FileEntry:
        """fsync and close; the file's manifest entry."""
        try:
            os.fsync(self._fd)
        finally:
            self.close()
        return FileEntry(self.name, self._size, self._hash.hexdigest())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_file(root: Path, name: str, *arrays: np.ndarray) -> FileEntry:
    """Write ``arrays``' bytes, in order, to a new file; fsynced."""
    writer = HashedWriter(root, name)
    try:
        for array in arrays:
            writer.write(array)
    except BaseException:
        writer.close()
        raise
    return writer.finish()


class VerifiedReader:
    """Reads a checkpoint file into given arrays, checking its size first and its sha256 at the end.

    Args:
        root: the checkpoint directory.
        entry: the file's manifest entry.
        cancel: checked between chunks; set: :class:`RestoreCancelled`.
    """

    def __init__(self, root: Path, entry: FileEntry, cancel: threading.Event | None = None) -> None:
        self.entry = entry
        self._cancel = cancel
        fd = open_regular(root / entry.name, entry.name)
        self._file = open(fd, "rb", buffering=0)  # noqa: SIM115 - closed by finish/close
        size = os.fstat(fd).st_size
        if size != entry.nbytes:
            self._file.close()
            raise CorruptCheckpointError(
                f"{entry.name} is {size} bytes but the manifest says {entry.nbytes} "
                f"({'truncated' if size < entry.nbytes else 'too long'})")
        self._hash = hashlib.sha256()

    def read_into(self, array: np.ndarray) -> None:
        """Fill ``array`` (C-contiguous) with the next ``array.nbytes`` bytes of the file."""
        data = as_bytes(array)
        for start in range(0, data.size, READ_CHUNK):
            if self._cancel is not None and self._cancel.is_set():
                raise RestoreCancelled("restore cancelled")
            chunk = data[start : start + READ_CHUNK]
            view = memoryview(chunk)
            while view.nbytes:
                try:
                    n = self._file.readinto(view)
                except OSError as exc:
                    raise CorruptCheckpointError(
                        f"cannot read {self.entry.name}: {exc.strerror}") from None
                if not n:
                    raise CorruptCheckpointError(f"{self.entry.name} ended early (truncated)")
                view = view[n:]
            self._hash.update(chunk)

    def finish(self) -> None:
        """Check the sha256 of everything read (which must be the whole file) and close."""
        self.close()
        if self._hash.hexdigest() != self.entry.sha256:
            raise CorruptCheckpointError(
                f"{self.entry.name}: sha256 {self._hash.hexdigest()[:16]}... does not match "
                f"the manifest's {self.entry.sha256[:16]}... (damaged data)")

    def close(self) -> None:
        self._file.close()


def read_file(root: Path, entry: FileEntry, cancel: threading.Event | None = None) -> np.ndarray:
    """A whole (small) checkpoint file as verified uint8 bytes."""
    data = np.empty(entry.nbytes, dtype=np.uint8)
    reader = VerifiedReader(root, entry, cancel)
    try:
        reader.read_into(data)
    finally:
        reader.close()
    reader.finish()
    return data
