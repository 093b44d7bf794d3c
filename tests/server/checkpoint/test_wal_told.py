"""Told, not waited for: a caller that must never block (the service's event loop) hands the
log a callback (``WriteAheadLog.when_durable``) and a logged table stores a small insert at
once (``LoggedTable.insert_now_durable``), the answer going out when the callback says so.

The caller writes a quick group itself (no one else writing, no new segment due): at ``"os"``
that is all, and it is told before returning; at ``"fsync"`` the log's writer thread syncs
what was written (writes made meanwhile wait for the next sync) and tells. Every caller is
told exactly once, with the error a waiter would get if the write or sync failed, and a
record told durable is in the log (replay gives the rows back).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.checkpoint.wal.logged_table import LoggedTable
from replay_server.checkpoint.wal.replay import replay_log
from replay_server.engine.config import TableConfig
from replay_server.engine.incarnations import LocalIncarnations
from replay_server.engine.table_set import TableSet
from replay_server.errors import LogSpaceError, LogWriteError, RateLimitedError
from tests.server.engine.held import lock_held_elsewhere


class Told:
    """A callback recording what it was told and on which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[BaseException | None, str]] = []
        self.event = threading.Event()

    def __call__(self, error: BaseException | None) -> None:
        self.calls.append((error, threading.current_thread().name))
        self.event.set()

    def wait(self) -> tuple[BaseException | None, str]:
        assert self.event.wait(10), "never told"
        assert len(self.calls) == 1, f"told {len(self.calls)} times"
        return self.calls[0]


def _log(directory: Path, sync: str, **kwargs) -> WriteAheadLog:
    options = {"max_bytes": 64 << 20, **kwargs}
    return WriteAheadLog(directory, shard=0, incarnation=1, first_index=0, sync=sync, **options)


def _tables() -> TableSet:
    configs = [TableConfig(name="t", capacity=1000, sampler="prioritized", seed=0)]
    return TableSet(configs, LocalIncarnations(0, 1), make_table=LoggedTable)


def _rows(n: int, start: float = 0.0) -> dict:
    return {"x": torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)}


def test_at_os_a_quick_group_is_written_by_the_caller_before_it_returns(tmp_path) -> None:
    log = _log(tmp_path, "os")
    before = log.nbytes
    told = Told()
    log.when_durable(log.append([b"record"]), told, lead=True)
    assert told.calls == [(None, threading.current_thread().name)]  # told before returning
    assert log.nbytes == before + len(b"record")
    log.close()


def test_at_fsync_the_writer_thread_writes_the_group_and_tells_every_caller(
        tmp_path, monkeypatch) -> None:
    syncs = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    log = _log(tmp_path, "fsync")
    toldes = [Told() for _ in range(5)]
    numbers = [log.append([b"r%d" % i]) for i in range(5)]
    for number, told in zip(numbers, toldes):
        log.when_durable(number, told, lead=True)  # fsync: never in the caller
    for told in toldes:
        error, thread = told.wait()
        assert error is None and thread == "replay-wal-writer"
    assert 1 <= len(syncs) <= 5
    log.close()


class HeldSync:
    """``os.fdatasync`` that blocks until released, counting its calls."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        real = os.fdatasync

        def sync(fd: int) -> None:
            self.calls += 1
            self.entered.set()
            assert self.release.wait(10)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", sync)


def test_at_fsync_the_caller_writes_and_the_writer_thread_syncs_before_telling(
        tmp_path, monkeypatch) -> None:
    """The quick write is the caller's; the sync, and so the answer, the writer thread's.
    Writes made while a sync runs are covered by the next one, never told early."""
    log = _log(tmp_path, "fsync")
    held = HeldSync(monkeypatch)
    first, second = Told(), Told()
    size = log.nbytes
    log.when_durable(log.append([b"a" * 10]), first, lead=True)
    assert log.nbytes == size + 10  # written here, at once
    assert held.entered.wait(10)  # the writer thread syncs it
    log.when_durable(log.append([b"b" * 10]), second, lead=True)
    assert log.nbytes == size + 20  # written while the sync runs
    assert first.calls == [] and second.calls == []  # neither is synced yet
    held.release.set()
    assert first.wait() == (None, "replay-wal-writer")
    assert second.wait() == (None, "replay-wal-writer")
    assert held.calls == 2  # the second write needed a sync of its own
    log.close()


def test_a_blocking_waiter_syncs_what_a_quick_write_wrote(tmp_path) -> None:
    log = _log(tmp_path, "fsync")
    number = log.append([b"c"])
    log.when_durable(number, Told(), lead=True)
    log.wait(number)  # returns once synced, by the writer thread or by this caller
    log.close()


def test_a_failed_sync_fails_what_it_covered_and_breaks_the_log(tmp_path, monkeypatch) -> None:
    log = _log(tmp_path, "fsync")

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    told = Told()
    log.when_durable(log.append([b"d"]), told, lead=True)
    error, _ = told.wait()
    assert isinstance(error, LogWriteError) and "Input/output error" in str(error)
    with pytest.raises(LogWriteError, match="cannot be written"):
        log.append([b"e"])
    log.close()


def test_a_record_durable_already_is_told_at_once(tmp_path) -> None:
    log = _log(tmp_path, "fsync")
    number = log.append([b"x"])
    log.wait(number)
    told = Told()
    log.when_durable(number, told)
    assert told.calls == [(None, threading.current_thread().name)]
    log.close()


@pytest.mark.parametrize("sync", ["os", "fsync"])
def test_a_failed_write_tells_its_callers_the_error_a_waiter_gets(
        tmp_path, monkeypatch, sync) -> None:
    log = _log(tmp_path, sync)

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    told, waited = Told(), log.append([b"y"])
    log.when_durable(log.append([b"x"]), told, lead=True)
    error, _ = told.wait()
    assert isinstance(error, LogSpaceError) and "disk is full" in str(error)
    with pytest.raises(LogSpaceError, match="not acknowledged"):
        log.wait(waited)  # the same group, the same words
    log.close()


def test_close_writes_and_syncs_what_told_callers_wait_for(tmp_path) -> None:
    log = _log(tmp_path, "fsync")
    toldes = [Told() for _ in range(20)]
    for k, told in enumerate(toldes):
        log.when_durable(log.append([b"z" * 100]), told, lead=k % 2 == 0)
    log.close()
    assert all(told.wait()[0] is None for told in toldes)


@pytest.mark.parametrize("sync", ["os", "fsync"])
def test_an_insert_stored_now_is_answered_once_its_record_is_durable(tmp_path, sync) -> None:
    tables = _tables()
    table = tables["t"]
    log = _log(tmp_path, sync)
    table.attach(log)
    table.insert(_rows(2))  # allocates (logged, waited for): inserts after it are quick
    toldes = []
    for call in range(10):
        told = Told()
        done = table.insert_now_durable(_rows(3, 10.0 * call), np.full(3, 1.0 + call), told)
        assert done is not None and done[1] is True  # stored, its answer waits for the log
        toldes.append(told)
    for told in toldes:
        assert told.wait()[0] is None
    table.attach(None)
    log.close()

    again = _tables()  # a restart from the log alone: the same rows, ids and priorities
    report = replay_log(tmp_path, again, start=None, start_incarnation=None, shard=0,
                        last_incarnation=1)
    assert report.applied == 11 and not report.cut
    mine, theirs = table.state_dict(), again["t"].state_dict()
    assert torch.equal(mine["columns"]["x"], theirs["columns"]["x"])
    torch.testing.assert_close(mine["sampler"], theirs["sampler"], rtol=0, atol=0)


def test_what_cannot_be_quick_stores_nothing_and_is_left_to_the_blocking_insert(
        tmp_path) -> None:
    tables = _tables()
    table = tables["t"]
    log = _log(tmp_path, "fsync", max_bytes=4096)
    table.attach(log)
    assert table.insert_now_durable(_rows(1), None, Told()) is None  # allocates: not quick
    table.insert(_rows(2))
    seq = table.log_seq
    with table._order:  # another change is being logged
        assert table.insert_now_durable(_rows(1), None, Told()) is None
    with lock_held_elsewhere(table):
        assert table.insert_now_durable(_rows(1), None, Told()) is None
    big = {"x": torch.zeros(200, 1)}  # 800 bytes: the log (4 KiB) would need a checkpoint
    while log.nbytes + 800 <= log.max_bytes:
        table.insert(big)
    seq, size = table.log_seq, table.size
    assert table.insert_now_durable(big, None, Told()) is None  # never refused here
    assert (table.log_seq, table.size) == (seq, size)
    table.attach(None)
    log.close()
    done = table.insert_now_durable(_rows(1), None, Told())
    assert done is not None and done[1] is False  # no log: nothing to wait for


def test_a_rate_limited_insert_is_raised_with_nothing_stored_or_logged(tmp_path) -> None:
    config = TableConfig(name="t", capacity=100, sampler="uniform", seed=0,
                         min_size_to_sample=2, samples_per_insert=1.0, error_buffer=1.0)
    table = TableSet([config], LocalIncarnations(0, 1), make_table=LoggedTable)["t"]
    log = _log(tmp_path, "os")
    table.attach(log)
    table.insert(_rows(3))  # filling up is free; the count is at its top now
    seq, size = table.log_seq, table.size
    with pytest.raises(RateLimitedError):
        table.insert_now_durable(_rows(2), None, Told())
    assert (table.log_seq, table.size) == (seq, size)
    table.attach(None)
    log.close()


@pytest.mark.parametrize("sync", ["os", "fsync"])
def test_an_update_applied_now_is_answered_once_its_record_is_durable(tmp_path, sync) -> None:
    tables = _tables()
    table = tables["t"]
    log = _log(tmp_path, sync)
    table.attach(log)
    ids = table.insert(_rows(4))
    told = Told()
    done = table.update_priorities_now_durable(ids[:2], np.array([5.0, 7.0]), told)
    assert done == (2, True)  # applied, its answer waits for the log
    assert told.wait()[0] is None
    with table._order:  # another change is being logged: left to the blocking update
        assert table.update_priorities_now_durable(ids, np.ones(4), Told()) is None
    table.attach(None)
    log.close()
    assert table.update_priorities_now_durable(ids[:1], np.ones(1), Told()) == (1, False)

    again = _tables()  # the update is in the log: replay gives the same priorities
    replay_log(tmp_path, again, start=None, start_incarnation=None, shard=0, last_incarnation=1)
    again["t"].update_priorities(ids[:1], np.ones(1))  # the one made with no log attached
    torch.testing.assert_close(table.state_dict()["sampler"], again["t"].state_dict()["sampler"],
                               rtol=0, atol=0)
