"""The checkpoint directory: naming, listing, locking, atomic commit and pruning.

Layout of ``checkpoint_dir``::

    LOCK                                  flock()ed by the server using the directory
    ckpt-20261121T212800.123Z-000007/     complete checkpoints (see manifest.py)
    ckpt-20261121T213800.456Z-000008.tmp/ one being written (or left by a crash)

A checkpoint is written under its ``.tmp`` name, every file fsynced, then the
directory is renamed to its final name and the parent directory fsynced: a
final name is only ever seen on a finished checkpoint (and the COMPLETE
marker inside, written last, double-checks that). ``.tmp`` directories are
leftovers of interrupted writes: removed at start and after each checkpoint.

Pruning keeps every checkpoint from the ``keep_latest``-th newest *verified*
one on: verified are the checkpoint the server restored from and those it
wrote complete and read back. So a damaged or unreadable checkpoint never
costs an older good one its place, and a server that started empty (by the
operator's choice) removes nothing until it has written ``keep_latest``
checkpoints of its own. A checkpoint written without some part (a *partial*
one, see :mod:`~replay_server.checkpoint.writer`) never counts as verified;
it is removed once a newer one holds everything it holds (a newer verified
one, or a newer partial one missing no part it has).

Checkpoints found damaged at start are never removed: they are left for the
operator (the start-up log names them), and a ``DAMAGED`` file written into
each (its reason inside) keeps them so across restarts, when a newer
checkpoint restores and the damaged one is not looked at again. Delete that
file after repairing one.

Files and directories are created owner-only (0600 and 0700): a checkpoint
holds the replay data, which other local users must not read.
The sequence number orders checkpoints (clocks can go backwards); it is one
more than the largest on disk.

Thread-safety: one checkpoint is written at a time (the
:class:`~replay_server.checkpoint.checkpointer.Checkpointer` sees to it);
the LOCK keeps a second server away from the directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from replay_server.errors import ConfigError

log = logging.getLogger("replay_server.checkpoint")

_COMPLETE_NAME = re.compile(r"^ckpt-(\d{8}T\d{6}\.\d{3}Z)-(\d{6,})$")
_TEMP_NAME = re.compile(r"^ckpt-(\d{8}T\d{6}\.\d{3}Z)-(\d{6,})\.tmp$")
LOCK_NAME = "LOCK"
DAMAGED_NAME = "DAMAGED"
"""Written into a checkpoint found damaged at start: pruning never removes it."""


@dataclass(frozen=True, slots=True, order=True)
class CheckpointRef:
    """A complete-looking checkpoint directory (by its name), ordered by sequence."""

    sequence: int
    path: Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDirectory:
    """One server's ``checkpoint_dir``. See the module docstring.

    Args:
        path: the directory; created (with parents) by :meth:`open` if missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()
        self._lock_fd: int | None = None
        self._verified: set[Path] = set()
        self._partial: dict[Path, frozenset[str]] = {}  # path -> the parts it lacks
        self._damaged: set[Path] = set()

    def open(self) -> None:
        """Create the directory if needed, lock it and remove unfinished checkpoints.

        Raises:
            ConfigError: the path is not a directory, cannot be created or
                written, or another server holds its lock.
        """
        where = f"checkpoint directory {str(self.path)!r}"
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"{where} is not a directory")
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"{where} cannot be created or written: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(
                    f"{where} is in use by another server (it holds {LOCK_NAME}); each server "
                    f"needs its own checkpoint_dir") from None
            raise ConfigError(f"{where}: cannot lock {LOCK_NAME}: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        for temp in self.temporaries():
            log.warning("removing unfinished checkpoint %s (a write was interrupted)", temp)
            self.discard(temp)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def complete(self) -> list[CheckpointRef]:
        """Checkpoints with a final name, oldest first (their contents are not checked here)."""
        refs = []
        for entry in self._entries():
            match = _COMPLETE_NAME.match(entry.name)
            if match and entry.is_dir():
                refs.append(CheckpointRef(int(match.group(2)), entry))
        return sorted(refs)

    def temporaries(self) -> list[Path]:
        """``.tmp`` directories: checkpoints being written or left by an interrupted write."""
        return sorted(e for e in self._entries() if _TEMP_NAME.match(e.name))

    def begin(self) -> tuple[int, Path, Path]:
        """Create the temporary directory of the next checkpoint.

        Returns:
            ``(sequence, temporary path, final path)``.
        """
        names = [_COMPLETE_NAME.match(e.name) or _TEMP_NAME.match(e.name) for e in self._entries()]
        sequence = 1 + max((int(m.group(2)) for m in names if m), default=0)
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
        final = self.path / f"ckpt-{stamp}-{sequence:06d}"
        temp = final.with_name(final.name + ".tmp")
        temp.mkdir(mode=0o700)
        return sequence, temp, final

    def commit(self, temp: Path, final: Path) -> None:
        """Atomically give a fully written (and fsynced) checkpoint its final name."""
        fsync_dir(temp)
        os.rename(temp, final)
        fsync_dir(self.path)

    def discard(self, path: Path) -> None:
        """Remove a checkpoint directory; failures are logged, never raised."""
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)

    def mark_verified(self, path: Path) -> None:
        """``path`` is known good: restored from, or written and read back."""
        self._verified.add(path)

    def mark_partial(self, path: Path, missing: set[str] | frozenset[str]) -> None:
        """``path`` is good but lacks the parts ``missing`` (written without them)."""
        self._partial[path] = frozenset(missing)

    def mark_damaged(self, path: Path, reason: str = "") -> None:
        """``path`` was found damaged at start: pruning leaves it for the operator, in this
        run and the next ones (a ``DAMAGED`` file says why; failing to write it is logged)."""
        self._damaged.add(path)
        try:
            fd = os.open(path / DAMAGED_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, f"found damaged at start: {reason}\n".encode()[:65536])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("could not mark %s as damaged (%s): it is kept while this server "
                        "runs, but a later one may prune it", path, exc.strerror or exc)

    def is_damaged(self, path: Path) -> bool:
        """Whether ``path`` was found damaged, by this server or an earlier one."""
        return path in self._damaged or (path / DAMAGED_NAME).exists()

    def prune(self, keep_latest: int) -> list[Path]:
        """Remove checkpoints older than the ``keep_latest``-th newest verified one, and
        leftover temporaries (see the module docstring).

        Call only while no checkpoint is being written. Returns what was removed.
        """
        complete = self.complete()
        verified = [ref for ref in complete if ref.path in self._verified]
        old: list[Path] = []
        if len(verified) >= keep_latest:
            oldest_kept = verified[-keep_latest].sequence
            old = [ref.path for ref in complete if ref.sequence < oldest_kept]
        old += [ref.path for ref in complete
                if ref.path in self._partial and ref.path not in old
                and self._superseded(ref, complete)]
        old = [path for path in old if not self.is_damaged(path)]
        self._verified.difference_update(old)
        for path in old:
            self._partial.pop(path, None)
        removed = old + self.temporaries()
        for path in removed:
            self.discard(path)
        if removed:
            try:
                fsync_dir(self.path)
            except OSError as exc:
                log.warning("could not fsync %s: %s", self.path, exc)
        return removed

    def _superseded(self, partial: CheckpointRef, complete: list[CheckpointRef]) -> bool:
        """Whether a newer checkpoint holds every part ``partial`` holds."""
        missing = self._partial[partial.path]
        return any(ref.sequence > partial.sequence and (
            ref.path in self._verified
            or (ref.path in self._partial and self._partial[ref.path] <= missing))
            for ref in complete)

    def _entries(self) -> list[Path]:
        try:
            return list(self.path.iterdir())
        except FileNotFoundError:
            return []
