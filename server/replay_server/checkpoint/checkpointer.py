"""The server's checkpointer: restore at start, then one checkpoint at a time.

Concurrent requests: a checkpoint always *starts after* the request for it
arrived, so it holds everything acknowledged before the request. A request
that arrives while a checkpoint is being written waits for that one to end,
then all requests that waited share the next checkpoint (one write for
all of them, however many asked: the timer, the Checkpoint RPC, shutdown).

Thread-safety: every method may be called from any thread; :meth:`checkpoint`
blocks its caller for the duration of the write (run it off the event loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from replay_server.checkpoint.directory import CheckpointDirectory
from replay_server.checkpoint.reader import RestoreResult, restore_latest
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.checkpoint.writer import CheckpointResult, write_checkpoint
from replay_server.errors import CheckpointWriteError
from replay_server.engine import DEFAULT_CHUNK_BYTES, Table, TableSet, VariableStore

log = logging.getLogger("replay_server.checkpoint")

_KEEP_OUTCOMES = 16


class Checkpointer:
    """Owns a checkpoint directory for one server.

    Args:
        path: the checkpoint directory (created if missing).
        keep_latest: complete checkpoints kept; older ones are removed after
            each new one.
        server_version: recorded in every manifest.
        chunk_bytes: rows copied per lock hold while snapshotting.
    """

    def __init__(
        self, path: str | Path, *, keep_latest: int, server_version: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.directory = CheckpointDirectory(path)
        self.keep_latest = keep_latest
        self._server_version = server_version
        self._chunk_bytes = chunk_bytes
        self._cond = threading.Condition()
        self._started = 0  # rounds started
        self._running = False
        self._outcomes: dict[int, CheckpointResult | BaseException] = {}
        self.last: CheckpointResult | None = None
        """The newest checkpoint written since the server started (``None``: none yet)."""
        self.last_finished_at: float | None = None
        """Wall-clock time (``time.time()``) at which :attr:`last` was finished."""
        self.written = 0
        """Checkpoints written since the server started."""
        self.failed = 0
        """Checkpoint writes that failed since the server started."""
        self.log: WriteAheadLog | None = None
        """The write-ahead log each checkpoint truncates (set once it is replayed and open)."""

    @property
    def path(self) -> Path:
        return self.directory.path

    def open(self) -> None:
        """Create and lock the directory, remove unfinished checkpoints.

        Raises:
            ConfigError: the directory cannot be used (see CheckpointDirectory.open).
        """
        self.directory.open()

    def close(self) -> None:
        self.directory.close()

    def restore(
        self, make_tables: Callable[[], TableSet], cancel: threading.Event | None = None,
        make_variables: Callable[[], VariableStore] | None = None, *, start_empty: bool = False,
    ) -> tuple[TableSet, RestoreResult] | None:
        """See :func:`~replay_server.checkpoint.reader.restore_latest`."""
        return restore_latest(self.directory, make_tables, cancel, make_variables,
                              start_empty=start_empty)

    def checkpoint(self, tables: Iterable[Table], reason: str = "request", *,
                   variables: VariableStore | None = None) -> CheckpointResult:
        """Write a checkpoint that starts after this call (shared with concurrent callers).

        Each write is logged once: INFO with its path, size and speed, or
        ERROR with the cause. ``reason`` (what asked for it) goes in the log.
        ``variables``: the named variables, saved with the tables. A caller
        sharing a write that another caller started gets that write.

        A checkpoint written without some part (:attr:`CheckpointResult.failed`)
        is returned like any other, and logged at ERROR naming the parts.

        Raises:
            CheckpointWriteError: the write failed (every caller sharing it gets the error).
        """
        with self._cond:
            wanted = self._started + 1
            while wanted not in self._outcomes:
                if not self._running and self._started < wanted:
                    self._running = True
                    self._started = wanted
                    break
                self._cond.wait()
            else:
                return self._outcome(wanted)
        outcome: CheckpointResult | BaseException
        try:
            outcome = write_checkpoint(
                tables, self.directory, keep_latest=self.keep_latest,
                server_version=self._server_version, chunk_bytes=self._chunk_bytes,
                variables=variables, log=self.log)
        except CheckpointWriteError as exc:
            log.error("checkpoint (%s) failed: %s", reason, exc)
            outcome = exc
        except BaseException as exc:
            log.error("checkpoint (%s) failed unexpectedly", reason, exc_info=exc)
            outcome = exc
        else:
            log.info("checkpoint (%s) written: %s (%s tables, %.1f MB in %.2f s, %.2f GB/s)%s",
                     reason, outcome.path, len(outcome.tables), outcome.nbytes / 1e6,
                     outcome.seconds, outcome.gb_per_s,
                     f"; removed {len(outcome.removed)} older" if outcome.removed else "")
            if outcome.failed:
                log.error("checkpoint (%s) %s", reason, partial_message(outcome))
        with self._cond:
            self._running = False
            self._outcomes[wanted] = outcome
            for old in [r for r in self._outcomes if r <= wanted - _KEEP_OUTCOMES]:
                del self._outcomes[old]
            if isinstance(outcome, CheckpointResult):
                self.last, self.last_finished_at = outcome, time.time()
                self.written += 1
            else:
                self.failed += 1
            self._cond.notify_all()
            return self._outcome(wanted)

    def _outcome(self, round_: int) -> CheckpointResult:
        outcome = self._outcomes[round_]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def partial_message(result: CheckpointResult) -> str:
    """What a checkpoint written without some parts lacks, for logs and errors."""
    missing = "; ".join(f"{part.describe()} ({part.error})" for part in result.failed)
    return (f"{result.path} was written without {missing}; every other part is saved, and a "
            f"restore takes the missing ones from an older checkpoint")
