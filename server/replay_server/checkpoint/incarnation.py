"""The durable id incarnation counter of a checkpoint directory.

Row ids carry the incarnation of the run that issued them (see
:mod:`replay_server.engine.id_space`). A server with a ``checkpoint_dir``
takes its incarnation from the ``INCARNATION`` file there: it reads the
last one given out, adds one and writes it back (a temporary file, fsynced,
renamed over the old one, the directory fsynced) *before* it serves a call.
So a run that crashes, even one that never wrote a checkpoint, has used up
its incarnation: no later run issues its ids again. Rolling a table over to a
new segment (every 2**40 rows) takes a new incarnation the same way.

The file holds one decimal number and a newline, mode 0600. An unreadable
file stops the start (guessing could reissue ids); a missing one starts the
count at 1. Never delete it while the checkpoints are kept: a restored
table's segments keep later incarnations above theirs, but ids of runs that
crashed before their first checkpoint are only ruled out by this file.

Thread-safety: :meth:`advance` may be called from any thread (a table
rolling over, under its own lock); one writer at a time.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from replay_server.checkpoint.directory import fsync_dir
from replay_proto.id_layout import MAX_INCARNATION
from replay_server.engine import check_shard, exhausted_message
from replay_server.errors import ConfigError

INCARNATION_NAME = "INCARNATION"


class IncarnationFile:
    """A server's incarnations, counted durably in ``directory/INCARNATION``.

    Use :meth:`claim`, which gives out the run's first incarnation.

    Args:
        directory: the (locked) checkpoint directory.
        shard: the server's shard index, which its ids carry.
        current: the incarnation last written.
    """

    def __init__(self, directory: Path, shard: int, current: int) -> None:
        self.shard = check_shard(shard)
        self.path = directory / INCARNATION_NAME
        self._current = current
        self._lock = threading.Lock()

    @classmethod
    def claim(cls, directory: Path, shard: int) -> IncarnationFile:
        """Read the last incarnation, write the next, and return the counter holding it.

        Raises:
            ConfigError: the file cannot be read, parsed or written, or every
                incarnation is used up.
        """
        path = directory / INCARNATION_NAME
        try:
            text = path.read_text()
        except FileNotFoundError:
            last = 0
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
        else:
            if not text.strip().isdigit() or not 0 <= int(text) <= MAX_INCARNATION:
                raise ConfigError(
                    f"{path} should hold the last id incarnation (a number in 0..{MAX_INCARNATION}) "
                    f"but holds {text[:40]!r}; restore it from a backup (a guess could issue old "
                    f"ids again)")
            last = int(text)
        counter = cls(directory, shard, last)
        counter.advance(last)
        return counter

    @property
    def current(self) -> int:
        return self._current

    def advance(self, floor: int) -> int:
        """Write a new incarnation above ``floor`` and the current one; it becomes current.

        Raises:
            ConfigError: every incarnation is used up, or the file cannot be written.
        """
        with self._lock:
            new = max(self._current, floor) + 1
            if new > MAX_INCARNATION:
                raise ConfigError(f"{self.path}: {exhausted_message()}")
            temp = self.path.with_name(INCARNATION_NAME + ".tmp")
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, f"{new}\n".encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(temp, self.path)
                fsync_dir(self.path.parent)
            except OSError as exc:
                raise ConfigError(f"cannot write {self.path}: {exc.strerror}") from None
            self._current = new
            return new
