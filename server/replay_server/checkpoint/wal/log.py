"""The write-ahead log: segment files written by one thread, with group commit.

A change is :meth:`~WriteAheadLog.append`\\ ed (its record queued, in the
order its table applied it) and then :meth:`~WriteAheadLog.wait`\\ ed for:
the answer to a client goes out only once its record is durable at the
configured level. Group commit, led by the callers themselves: a caller
whose record is not durable yet, while no one is writing, becomes the
*leader*: it takes everything queued (its own record and every one queued
before it not yet written), encodes it, and writes it with one ``writev``
and, at ``sync = "fsync"``, one ``fdatasync``, outside every lock; callers
that queue meanwhile wait, and the first of them to wake leads the next
group. So concurrent callers share one disk round trip, and a group costs
no hand-over to another thread (on a busy machine each such hand-over
waited for a turn at the interpreter: a writer thread made each call pay
two). A caller that must never block (the service's event loop, for a small
insert on a call stream) asks instead to be told (:meth:`when_durable`): it
writes the group at once itself when that is quick (no one writing, no new
segment due: a ``writev`` into the file cache), which at ``"os"`` is all;
the sync at ``"fsync"``, and every write that is not quick, is the log's
writer thread's, which then tells every such caller in the group. (A
writer thread leading it all cost each told caller 0.4 ms more on the
2-core machine: the thread's encoding and ``writev`` waited for turns at the
interpreter while the loop ran.)

Levels: ``"os"``: written into the operating system's file cache (survives
a crash of the process: ``kill -9``, an OOM kill); ``"fsync"``: on disk
(survives power loss too).

Segments rotate at ``segment_bytes`` and when a checkpoint starts
(:meth:`rotate`: every record queued before it lies in older segments, so a
checkpoint whose snapshots start afterwards covers them); once the
checkpoint is complete, :meth:`truncate` deletes the covered segments.

**Bound.** :meth:`admit` is asked before a change is applied: past
``max_bytes`` it runs an early checkpoint (the ``checkpoint`` callable) and
refuses the change with :class:`~replay_server.errors.LogFullError` if the
log is still too large; half-way there it starts one in the background.
**Disk space.** :meth:`admit` also refuses a change the log's disk has no
room for (:class:`~replay_server.errors.LogSpaceError`, nothing applied): it
keeps an estimate of the free space, read with ``statvfs`` again whenever
the estimate comes within :data:`DISK_SLACK` of the change. A write that
fails all the same (another process took the space meanwhile, an I/O error)
is cut off the segment again (``ftruncate`` to its last whole record, so the
log holds no torn record), fails every change waiting on it and *breaks*
the log: changes are refused until a checkpoint succeeds (it holds what the
failed records held, and the log starts again after it).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay_server.checkpoint.wal.records import segment_header, segment_name
from replay_server.errors import LogFullError, LogSpaceError, LogWriteError

log = logging.getLogger("replay_server.wal")

SYNC_LEVELS = ("fsync", "os")
_IOV_MAX = 512
_ROTATE = object()
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_SLACK = 16 << 20
"""Free bytes (estimated) above a change's size under which :meth:`WriteAheadLog.admit`
reads the disk's free space again (``statvfs``) rather than trust its estimate."""
DISK_HEADROOM = 64 << 10
"""Free bytes a change must leave on the log's disk (a segment's next header, a page)."""

Durable = Callable[[BaseException | None], None]
"""Told once a record is durable (``None``) or its write failed (the error a waiter gets)."""


class WriteAheadLog:
    """One server's log in ``directory`` (see the module docstring).

    Args:
        directory: where segments go (created and locked by the caller).
        sync: ``"fsync"`` or ``"os"``.
        max_bytes: the bound on the segments kept (``server.wal_max_mb``).
        shard, incarnation: this run's, written into each segment header.
        first_index: the index of the first segment this run writes.
        segment_bytes: size at which a segment is closed and the next begun.
    """

    def __init__(self, directory: Path, *, sync: str, max_bytes: int, shard: int,
                 incarnation: int, first_index: int, segment_bytes: int = 64 << 20) -> None:
        assert sync in SYNC_LEVELS
        self.directory = directory
        self.sync = sync
        self.max_bytes = max_bytes
        self.checkpoint: Callable[[str], Any] | None = None
        """Writes a checkpoint (given a reason), raising if it fails; set by the server."""
        self._shard, self._incarnation = shard, incarnation
        self._segment_bytes = segment_bytes
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._wanted = threading.Condition(lock)  # the writer thread's: a told caller waits
        self._told: list[tuple[int, int, Durable]] = []  # heap: (number, tie, callback)
        self._ties = itertools.count()
        self._writer: threading.Thread | None = None
        self._pending: list[Any] = []
        self._appended = 0  # records given a number
        self._durable = 0  # every record numbered up to this one is durable (or failed)
        self._written = 0  # every record numbered up to this one is written (or failed)
        self._lost: list[tuple[int, int]] = []  # numbers whose write failed
        self._broken: str | None = None
        self._out_of_space = False  # the write that broke the log found no space
        self._free = -1  # estimated free bytes on the log's disk (-1: read it)
        self._closing = False
        self._early: threading.Thread | None = None
        self._sizes: dict[int, int] = {}  # segment index -> bytes, segments kept
        self._index = first_index
        self._fd: int | None = self._create(first_index)
        self._rotated: dict[int, int] = {}  # rotation ticket -> new index
        self._leading = False  # a caller is writing a group now
        self._syncing = False  # the writer thread syncs quick writes now (no segment change)

    # ------------------------------------------------------------- callers

    @property
    def nbytes(self) -> int:
        """Bytes of the segments kept (what the bound counts)."""
        return sum(list(self._sizes.values()))

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def admit(self, nbytes: int) -> None:
        """Refuse a change of about ``nbytes`` the log cannot take (before it is applied).

        Raises:
            LogFullError: past ``max_bytes`` even after an early checkpoint.
            LogWriteError: the log is broken (a write failed) and no checkpoint has mended it.
        """
        if self._broken is None and self.nbytes + nbytes <= self.max_bytes:
            if self.nbytes > self.max_bytes // 2:
                self._checkpoint_in_background()
            self._check_space(nbytes)
            return
        why = self._broken or "it is full"
        if self.checkpoint is not None and nbytes <= self.max_bytes:
            try:
                self.checkpoint("write-ahead log full" if self._broken is None
                                else "write-ahead log broken")
            except Exception as exc:  # logged by the checkpointer
                why = f"{why}, and the early checkpoint failed: {exc}"
        if self._broken is not None:
            error = LogSpaceError if self._out_of_space else LogWriteError
            raise error(
                f"the write-ahead log cannot be written ({why}); the change was refused and "
                f"nothing of it is stored; samples keep working, and writes resume after the "
                f"next successful checkpoint")
        if self.nbytes + nbytes > self.max_bytes:
            raise LogFullError(
                f"the write-ahead log holds {self.nbytes:,} bytes and this change needs "
                f"{nbytes:,} more, past server.wal_max_mb = {self.max_bytes >> 20} MB "
                f"({why}{'' if self.checkpoint else '; no checkpoint_dir to truncate it'}); "
                f"the change was refused and nothing of it is stored; samples keep working")

    def append(self, buffers: list[Any] | Callable[[], list[Any]]) -> int:
        """Queue one record (its buffers, written in order, or what makes them: called by the
        writer thread, so that checksums are computed outside the caller's locks); returns
        its number for :meth:`wait`.

        Raises:
            LogWriteError: the log is broken or closed (nothing queued).
        """
        with self._cond:
            if self._broken is not None or self._closing:
                raise LogWriteError(f"the write-ahead log cannot be written "
                                    f"({self._broken or 'closed'}); the change was not logged")
            self._appended += 1
            self._pending.append((self._appended, buffers))
            return self._appended

    def wait(self, number: int) -> None:
        """Block until record ``number`` is durable at the configured level.

        Raises:
            LogWriteError: its write failed (the change is applied but was never acknowledged).
        """
        with self._cond:
            self._until(lambda: number <= self._durable or self._failed(number))
            if self._failed(number):
                raise self._error(number)

    def may_admit(self, nbytes: int) -> bool:
        """:meth:`admit` for a caller that must never block: ``False`` (nothing refused) where
        it could block (an early checkpoint: the log is full or broken), else as :meth:`admit`
        (:class:`LogSpaceError` included; it may read ``statvfs``)."""
        if self._broken is not None or self.nbytes + nbytes > self.max_bytes:
            return False
        self.admit(nbytes)
        return True

    def when_durable(self, number: int, told: Durable, *, lead: bool = False) -> None:
        """Call ``told(None)`` once record ``number`` is durable, or ``told(error)`` (the error
        :meth:`wait` would raise) if its write failed; from the thread that wrote its group,
        so ``told`` must be quick and must not block (hand the news to a loop). For a caller
        that must never block: the log's writer thread writes the group. ``lead``:
        write the group in this thread now if that is quick (no one is writing and no new
        segment is due: a ``writev`` into the file cache): at ``"os"`` ``told`` is then
        called before this returns; at ``"fsync"`` the writer thread syncs it."""
        with self._cond:
            heapq.heappush(self._told, (number, next(self._ties), told))
            if number <= self._durable or self._failed(number):
                self._tell(number)
                return
            if (lead and not self._leading and self._pending
                    and self._sizes[self._index] <= self._segment_bytes
                    and all(item is not _ROTATE for _, item in self._pending)):
                self._lead(sync=False)  # at "os", durable now: told
            if self._told:
                self._start_writer()
                self._wanted.notify()

    def rotate(self) -> int:
        """Begin a new segment after everything queued so far; returns its index.

        Raises:
            OSError: the new segment cannot be created (the log is then broken).
        """
        with self._cond:
            if self._closing:
                raise OSError(errno.EIO, "write-ahead log: closed")
            self._appended += 1
            ticket = self._appended
            self._pending.append((ticket, _ROTATE))
            self._until(lambda: ticket in self._rotated or self._failed(ticket))
            if ticket not in self._rotated:
                raise OSError(errno.EIO, f"write-ahead log: {self._broken}")
            return self._rotated.pop(ticket)

    def truncate(self, first_kept: int) -> None:
        """A checkpoint covering every segment before ``first_kept`` is complete: delete them,
        and mend a broken log (the checkpoint holds what its failed records held)."""
        for index in sorted(i for i in list(self._sizes) if i < first_kept):
            try:
                (self.directory / segment_name(index)).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("write-ahead log: cannot delete %s: %s", segment_name(index), exc)
                continue
            self._sizes.pop(index, None)
        with self._cond:
            if self._broken is not None and first_kept <= self._index:
                log.info("write-ahead log mended by a checkpoint: writes are accepted again")
                self._broken = None
                self._out_of_space = False
                self._free = -1

    def close(self) -> None:
        """Write what is queued, stop the writer, close the segment."""
        with self._cond:
            self._closing = True
            self._wanted.notify_all()
            self._until(lambda: not self._pending and not self._leading
                        and self._written <= self._durable)
        if self._writer is not None:
            self._writer.join(timeout=5)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -------------------------------------------------------------- writer

    def _start_writer(self) -> None:
        """Under the condition: start the writer thread if it is not running."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_for_told, daemon=True,
                                            name="replay-wal-writer")
            self._writer.start()

    def _write_for_told(self) -> None:
        """The writer thread: leads a group whenever a told caller's record waits in the
        queue and no one is writing; ends when the log closes (:meth:`close` writes the rest)."""
        with self._cond:
            while not self._closing:
                if not self._told or self._leading or self._syncing:
                    self._wanted.wait()
                elif self._pending:
                    self._lead()
                elif self._written > self._durable:
                    self._sync_written()
                else:
                    self._wanted.wait()

    def _tell(self, upto: int) -> None:
        """Under the condition: tell every told caller whose record is numbered up to ``upto``
        (each is durable or failed by now)."""
        while self._told and self._told[0][0] <= upto:
            number, _, told = heapq.heappop(self._told)
            error = self._error(number) if self._failed(number) else None
            try:
                told(error)
            except Exception:  # a caller's bug must not break the log's writer
                log.exception("write-ahead log: telling a caller its record's fate failed")

    def _error(self, number: int) -> LogWriteError:
        """What a change whose record ``number`` failed is answered with."""
        error = LogSpaceError if self._out_of_space else LogWriteError
        return error(
            f"the write-ahead log could not be written ({self._broken or 'write failed'}); "
            f"the change was not acknowledged (it may or may not survive a crash)")

    def _check_space(self, nbytes: int) -> None:
        """Refuse a change the log's disk has no room for (see the module docstring)."""
        free = self._free - nbytes  # an estimate: concurrent callers may race on it
        if free > DISK_SLACK:
            self._free = free
            return
        try:
            stat = os.statvfs(self.directory)
        except OSError:
            return  # the write itself will tell
        self._free = stat.f_bavail * stat.f_frsize - nbytes
        if self._free < DISK_HEADROOM:
            raise LogSpaceError(
                f"no space left on the write-ahead log's disk ({self.directory}: "
                f"{max(self._free + nbytes, 0):,} bytes free, this change needs about "
                f"{nbytes:,}); the change was refused and nothing of it is stored; samples "
                f"keep working, and writes resume once there is space")

    def _failed(self, number: int) -> bool:
        return any(low <= number <= high for low, high in self._lost)

    def _checkpoint_in_background(self) -> None:
        if self.checkpoint is None or (self._early is not None and self._early.is_alive()):
            return
        self._early = threading.Thread(target=self._quiet_checkpoint, daemon=True,
                                       name="replay-wal-checkpoint")
        self._early.start()

    def _quiet_checkpoint(self) -> None:
        try:
            assert self.checkpoint is not None
            self.checkpoint("write-ahead log half full")
        except Exception:
            pass  # logged by the checkpointer; admit() tries again when it must

    def _create(self, index: int) -> int:
        path = self.directory / segment_name(index)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            header = segment_header(self._shard, self._incarnation, index)
            os.write(fd, header)
            os.fsync(fd)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)  # never a segment without a whole header
            raise
        self._sizes[index] = len(header)
        return fd

    def _until(self, done: Callable[[], bool]) -> None:
        """Under the condition: until ``done()``, write the queued group if no caller is
        writing one (this caller leads), else wait for the one who is."""
        while not done():
            if self._leading or self._syncing:
                self._cond.wait()
            else:
                self._lead()

    def _sync_written(self) -> None:
        """The writer thread: sync what quick writes wrote (under the condition, released
        while syncing). Quick writes may go on meanwhile (the next sync covers them); a group
        that writes, and so may change segments, waits for it."""
        upto, fd, broken = self._written, self._fd, self._broken
        assert fd is not None
        self._syncing = True
        self._cond.release()
        failure: tuple[str, bool] | None = None
        try:
            if broken is not None:  # a failed sync may have dropped these pages: never trust
                raise OSError(errno.EIO, broken)
            os.fdatasync(fd)
        except OSError as exc:
            failure = self._failure(exc)
        finally:
            self._cond.acquire()
            self._syncing = False
        if failure is None:
            self._durable = max(self._durable, upto)
        else:
            self._fail(*failure, upto)
        self._tell(upto)
        self._cond.notify_all()

    def _failure(self, exc: OSError) -> tuple[str, bool]:
        """What a failed write or sync says, and whether it found the disk full."""
        name = errno.errorcode.get(exc.errno or 0, "error")
        failure = f"{exc.strerror or exc} ({name}) in {segment_name(self._index)}"
        if exc.errno in _SPACE_ERRNOS:
            return f"the log's disk is full ({self.directory}): {failure}", True
        return failure, False

    def _fail(self, failure: str, out_of_space: bool, upto: int) -> None:
        """Under the condition: every record up to ``upto`` not yet durable failed (written
        and never synced ones too), and the log is broken until a checkpoint mends it."""
        if self._broken is None:
            self._broken = failure
            self._out_of_space = out_of_space
            self._free = -1
            log.error("write-ahead log write failed: %s; changes are refused until "
                      "a checkpoint succeeds", failure)
        self._lost.append((self._durable + 1, upto))
        self._written = self._durable = upto  # settled: failed

    def _owed(self) -> bool:
        """Under the condition: is a record queued, or written and not yet synced?"""
        return bool(self._pending) or self._written > self._durable

    def _lead(self, sync: bool = True) -> None:
        """Write everything queued as one group (called, and returning, under the condition;
        released while writing): the records before it were written by earlier leaders.
        At ``"fsync"`` the sync covers every record written before too; ``sync`` ``False``
        (a told caller's quick write): written only, a later group's sync covers it."""
        batch, self._pending = self._pending, []
        upto = batch[-1][0] if batch else self._written
        assert upto > self._durable, "a caller waits for a record no one queued"
        broken, self._leading = self._broken, True
        rotated: dict[int, int] = {}
        failure: tuple[str, bool] | None = None
        self._cond.release()
        try:
            if broken is not None:
                self._rotate_only(batch, rotated)
                raise OSError(errno.EIO, broken)
            self._write(batch, rotated, sync)
        except OSError as exc:
            failure = self._failure(exc)
        except Exception as exc:  # a bug: fail this group and break the log, never hang
            log.exception("write-ahead log: writing a group failed")
            failure = f"{type(exc).__name__}: {exc} in {segment_name(self._index)}", False
        finally:
            self._cond.acquire()
            self._leading = False
        self._rotated.update(rotated)
        done = failure is not None or sync or self.sync == "os"
        if failure is None:
            self._written = upto
            if done:
                self._durable = upto
        else:
            self._fail(*failure, upto)
        if done:
            self._tell(upto)
        self._cond.notify_all()
        if self._told and self._owed():
            self._wanted.notify()  # a told caller's record was queued while this group wrote

    def _write(self, batch: list[Any], rotated: dict[int, int], sync: bool) -> None:
        """Write a batch: its records, rotating where asked or where the segment is full."""
        buffers: list[Any] = []
        for number, item in batch:
            if item is _ROTATE or self._sizes[self._index] > self._segment_bytes:
                self._flush(buffers, sync=False)  # the segment's fsync follows
                buffers = []
                self._next_segment()
                if item is _ROTATE:
                    rotated[number] = self._index
                    continue
            buffers.extend(item() if callable(item) else item)
        self._flush(buffers, sync)

    def _flush(self, buffers: list[Any], sync: bool) -> None:
        if not buffers:
            if sync and self.sync == "fsync":  # a group of what quick writes wrote: sync it
                assert self._fd is not None
                os.fdatasync(self._fd)
            return
        assert self._fd is not None
        whole = self._sizes[self._index]  # the segment's bytes up to its last whole record
        total = 0
        try:
            for start in range(0, len(buffers), _IOV_MAX):
                chunk = buffers[start:start + _IOV_MAX]
                want = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in chunk)
                done = os.writev(self._fd, chunk)
                while done < want:  # a short write: the rest, from where it stopped
                    rest = b"".join(bytes(b) for b in chunk)[done:]
                    done += os.write(self._fd, rest)
                total += want
            if self.sync == "fsync" and sync:
                os.fdatasync(self._fd)
        except OSError:
            try:  # none of these records is acknowledged: leave no torn one behind
                os.ftruncate(self._fd, whole)
            except OSError as exc:
                log.error("write-ahead log: cannot cut a failed write off %s: %s (a restart "
                          "cuts it as a torn tail)", segment_name(self._index), exc)
            raise
        self._sizes[self._index] = whole + total

    def _rotate_only(self, batch: list[Any], rotated: dict[int, int]) -> None:
        """A broken log still begins the segments checkpoints ask for (its records fail)."""
        for number, item in batch:
            if item is _ROTATE:
                try:
                    self._next_segment()
                except OSError:
                    continue
                rotated[number] = self._index

    def _next_segment(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)  # a segment is whole before the next one gets a record
        fd = self._create(self._index + 1)  # the index is used only once its file exists
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._index += 1
