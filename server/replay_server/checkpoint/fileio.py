"""Checkpoint files: written once with a running sha256 and fsynced; read back verified.

Bytes go straight between numpy arrays and the file descriptor (no
intermediate copies); hashing and the system calls release the GIL, so a
checkpoint being written costs request threads little beyond CPU time.
"""

from __future__ import annotations

import hashlib
import os
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
        path = root / entry.name
        try:
            self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by finish/close
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot open {entry.name}: {exc.strerror}") from None
        size = os.fstat(self._file.fileno()).st_size
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
