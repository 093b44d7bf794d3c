"""A server's write-ahead log directory through a run: open, replay at start, log, close.

:class:`LogKeeper` is what the server holds: it opens (and, when it is not
the checkpoint directory, locks) ``wal_dir``, replays the log into the
restored tables (:mod:`~replay_server.checkpoint.wal.replay`), then opens
this run's :class:`~replay_server.checkpoint.wal.log.WriteAheadLog` and
attaches it to every table. With ``wal = false`` it only guards the start:
a log found in the directory holds changes no checkpoint has, so the server
refuses to start rather than drop them silently.

Thread-safety: used by the server's start and stop, one call at a time.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay_server.checkpoint.manifest import Manifest
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.checkpoint.wal.logged_table import LoggedTable
from replay_server.checkpoint.wal.logged_variables import LoggedVariableStore
from replay_server.checkpoint.wal.replay import ReplayReport, find_segments, replay_log
from replay_server.checkpoint.wal.sync_modes import SYNC_PROMISES
from replay_server.engine import TableSet
from replay_server.errors import ConfigError

log = logging.getLogger("replay_server.wal")

LOCK_NAME = "WAL.LOCK"

class LogKeeper:
    """The log of one server (see the module docstring).

    Args:
        path: the log's directory (``wal_dir``, else ``checkpoint_dir``).
        enabled: ``server.wal``.
        sync, max_bytes: ``server.wal_sync`` and ``server.wal_max_mb`` in bytes.
        shard: the server's shard.
        lock: whether to lock the directory (it is not the checkpoint directory,
            whose own lock covers it).
    """

    def __init__(self, path: Path, *, enabled: bool, sync: str, max_bytes: int, shard: int,
                 lock: bool) -> None:
        self.path = path
        self.enabled = enabled
        self.sync = sync
        self.max_bytes = max_bytes
        self.shard = shard
        self._lock = lock
        self._lock_fd: int | None = None
        self.log: WriteAheadLog | None = None
        self.report: ReplayReport | None = None

    @property
    def level(self) -> str:
        """What ``info`` and the start-up log say: ``"fsync"``, ``"os"`` or ``"off"``."""
        return self.sync if self.enabled else "off"

    def open(self) -> None:
        """Create (and lock) the directory; refuse a log found while ``wal`` is off.

        Raises:
            ConfigError: the directory cannot be used, is locked by another server, or
                holds a log while ``server.wal`` is false.
        """
        where = f"server.wal_dir {str(self.path)!r}"
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{where} cannot be created: {exc.strerror}") from None
        if self._lock:
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                raise ConfigError(f"{where} is in use by another server" if busy else
                                  f"{where}: cannot lock {LOCK_NAME}: {exc.strerror}") from None
            self._lock_fd = fd
        found = find_segments(self.path)
        if found and not self.enabled:
            raise ConfigError(
                f"server.wal is false but {self.path} holds a write-ahead log ({len(found)} "
                f"segment(s)) with changes no checkpoint may have: start with server.wal = "
                f"true to replay it (the next checkpoint then truncates it), or move it away "
                f"to start from the checkpoint alone")

    def replay(self, tables: TableSet, manifest: Manifest | None, last_incarnation: int,
               cancel: threading.Event | None = None,
               variables: LoggedVariableStore | None = None) -> ReplayReport:
        """Replay the log after ``manifest``'s checkpoint (``None``: none) into ``tables``
        (and ``variables``).

        Raises:
            CorruptLogError: see :func:`~replay_server.checkpoint.wal.replay.replay_log`.
        """
        # A checkpoint written without a part had that part restored from an older one, whose
        # log began earlier: it truncated nothing, so every segment kept is replayed.
        start, incarnation = (None, None) if manifest is None or manifest.wal is None \
            or manifest.failed else manifest.wal
        self.report = replay_log(self.path, tables, start=start, start_incarnation=incarnation,
                                 shard=self.shard, last_incarnation=last_incarnation,
                                 cancel=cancel, variables=variables)
        return self.report

    def start(self, tables: TableSet, incarnation: int, checkpoint: Callable[[str], Any] | None,
              variables: LoggedVariableStore | None = None) -> WriteAheadLog | None:
        """Open this run's log after the replay and attach it to every table and the
        variables (``wal`` on)."""
        if not self.enabled:
            return None
        assert self.report is not None, "replay first"
        self.log = WriteAheadLog(self.path, sync=self.sync, max_bytes=self.max_bytes,
                                 shard=self.shard, incarnation=incarnation,
                                 first_index=self.report.next_index)
        self.log.checkpoint = checkpoint
        for table in tables:
            assert isinstance(table, LoggedTable)
            table.attach(self.log)
        if variables is not None:
            variables.attach(self.log)
        log.info("write-ahead log on in %s (wal_sync = %s: %s; bound server.wal_max_mb = %d)",
                 self.path, self.sync, SYNC_PROMISES[self.sync], self.max_bytes >> 20)
        return self.log

    def close(self) -> None:
        """Stop logging (what is queued is written) and release the directory."""
        if self.log is not None:
            self.log.close()
            self.log = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
