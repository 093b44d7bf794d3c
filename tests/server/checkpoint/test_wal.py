"""The write-ahead log in process, on real files: group commit, replay, idempotence, bound.

Through real servers: tests/integration/test_wal_crash_loop.py and test_wal_damage.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from replay_server.checkpoint.wal import records
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.checkpoint.wal.logged_table import LoggedTable
from replay_server.checkpoint.wal.replay import replay_log
from replay_server.engine.config import TableConfig
from replay_server.engine.incarnations import LocalIncarnations
from replay_server.engine.leases import LeaseRequest
from replay_server.engine.table_set import TableSet
from replay_server.errors import CorruptLogError, LogFullError, LogSpaceError, LogWriteError
from tests.small_disk import small_disk

CONFIGS = [TableConfig(name="replay", capacity=1000, sampler="prioritized"),
           TableConfig(name="plain", capacity=100, sampler="uniform")]


def _tables(incarnation: int) -> TableSet:
    return TableSet(CONFIGS, LocalIncarnations(0, incarnation), make_table=LoggedTable)


def _log(directory: Path, incarnation: int, first_index: int = 0, **kwargs) -> WriteAheadLog:
    options = {"sync": "fsync", "max_bytes": 64 << 20, **kwargs}
    return WriteAheadLog(directory, shard=0, incarnation=incarnation, first_index=first_index,
                         **options)


def _run(directory: Path, tables: TableSet, incarnation: int, first_index: int = 0) -> dict:
    """Some of every logged change, from four threads at once; returns what was acknowledged."""
    log = _log(directory, incarnation, first_index)
    for table in tables:
        table.attach(log)
    acknowledged: dict[int, bytes] = {}
    lock = threading.Lock()

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            rows = rng.random((3, 5)).astype(np.float32)
            ids = tables["replay"].insert({"obs": rows}, priorities=rng.random(3) + 0.1)
            tables["replay"].update_priorities(ids[:2], torch.tensor([2.0, 3.0]))
            with lock:
                acknowledged.update({int(i): r.tobytes() for i, r in zip(ids, rows)})
            tables["plain"].insert({"x": torch.arange(2)})

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tables["plain"].reset()
    tables["plain"].insert({"x": torch.arange(3)})
    log.close()
    return acknowledged


def _state(table: LoggedTable) -> dict:
    state = table.state_dict()
    return {"ids": state["ids"], "columns": {k: v.clone() for k, v in state["columns"].items()},
            "sampler": state["sampler"], "seq": table.log_seq}


def _same(a: dict, b: dict) -> None:
    # the same id segments, but for the one the restoring run begins at the end
    assert a["ids"]["segments"][:-1] == b["ids"]["segments"][:len(a["ids"]["segments"]) - 1]
    assert a["seq"] == b["seq"]
    assert a["columns"].keys() == b["columns"].keys()
    for key in a["columns"]:
        assert torch.equal(a["columns"][key], b["columns"][key])
    torch.testing.assert_close(a["sampler"], b["sampler"], rtol=0, atol=0)


def test_replay_gives_back_the_tables_with_their_ids_and_priorities(tmp_path) -> None:
    original = _tables(1)
    acknowledged = _run(tmp_path, original, incarnation=1)
    restored = _tables(2)
    report = replay_log(tmp_path, restored, start=None, start_incarnation=None, shard=0,
                        last_incarnation=1)
    assert report.applied == 4 * 20 * 3 + 2 and report.skipped == 0 and not report.cut
    for name in ("replay", "plain"):
        _same(_state(original[name]), _state(restored[name]))
    ids = np.array(sorted(acknowledged), dtype=np.int64)
    assert restored["replay"].update_priorities(ids, np.ones(ids.size)) == ids.size
    # new rows after the replay get the new run's incarnation, never an old id
    new = restored["replay"].insert({"obs": torch.zeros(1, 5)})
    assert int(new[0]) >> 40 == 2 and int(new[0]) not in acknowledged


def test_replay_is_idempotent_and_a_second_run_follows_the_first(tmp_path) -> None:
    """Replaying the same log twice (a crash during a replay, then a restart) gives the same
    state; a run after a replay logs its own segment, and both replay into its ids."""
    _run(tmp_path, _tables(1), incarnation=1)
    once, twice = _tables(2), _tables(2)
    for tables in (once, twice):
        replay_log(tmp_path, tables, start=None, start_incarnation=None, shard=0,
                   last_incarnation=1)
    _same(_state(once["replay"]), _state(twice["replay"]))
    _run(tmp_path, once, incarnation=2, first_index=1)
    later = _tables(3)
    report = replay_log(tmp_path, later, start=None, start_incarnation=None, shard=0,
                        last_incarnation=2)
    assert report.segments == 2
    _same(_state(once["replay"]), _state(later["replay"]))
    incarnations = [segment[0] for segment in later["replay"].state_dict()["ids"]["segments"]]
    assert incarnations == [1, 2, 3]


def test_records_of_a_checkpointed_change_are_skipped_and_a_gap_fails(tmp_path) -> None:
    tables = _tables(1)
    _run(tmp_path, tables, incarnation=1)
    restored = _tables(2)
    restored["replay"].load_state_dict(tables["replay"].state_dict())  # a checkpoint of it all
    report = replay_log(tmp_path, restored, start=None, start_incarnation=None, shard=0,
                        last_incarnation=1)
    assert report.skipped == 4 * 20 * 2 and report.applied == 4 * 20 + 2
    data = (tmp_path / records.segment_name(0)).read_bytes()
    offset, payload = records.scan(data).records[1]  # a change goes missing
    end = offset + records.RECORD_HEADER_BYTES + len(payload)
    (tmp_path / records.segment_name(0)).write_bytes(data[:offset] + data[end:])
    with pytest.raises(CorruptLogError, match="the log lacks its changes"):
        replay_log(tmp_path, _tables(2), start=None, start_incarnation=None, shard=0,
                   last_incarnation=1)


def test_group_commit_writes_a_group_with_one_sync(tmp_path, monkeypatch) -> None:
    """Calls that wait together share writes: far fewer fdatasyncs than records."""
    import os

    syncs = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    tables = TableSet(CONFIGS[1:], LocalIncarnations(0, 1), make_table=LoggedTable)
    log = _log(tmp_path, 1)
    tables["plain"].attach(log)
    barrier = threading.Barrier(8)

    def writer() -> None:
        barrier.wait()
        for _ in range(25):
            tables["plain"].insert({"x": torch.arange(2)})

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log.close()
    assert tables["plain"].log_seq == 200
    assert 1 <= len(syncs) < 200


def test_the_bound_refuses_before_anything_is_applied(tmp_path) -> None:
    tables = TableSet(CONFIGS[1:], LocalIncarnations(0, 1), make_table=LoggedTable)
    log = _log(tmp_path, 1, max_bytes=4096)
    tables["plain"].attach(log)
    with pytest.raises(LogFullError, match="server.wal_max_mb"):
        for _ in range(1000):
            tables["plain"].insert({"x": torch.zeros(4, 32)})
    size = tables["plain"].size
    assert size == 4 * tables["plain"].log_seq  # the refused insert left nothing
    log.close()


def test_a_segment_whose_creation_a_crash_cut_short_is_removed(tmp_path) -> None:
    """The newest segment without a whole header (the server died creating it) held no change:
    it is removed and reported, and the next run's segment takes its index (no gap)."""
    _run(tmp_path, _tables(1), incarnation=1)
    unborn = tmp_path / records.segment_name(1)
    unborn.write_bytes(records.segment_header(0, 2, 1)[:7])
    report = replay_log(tmp_path, _tables(3), start=None, start_incarnation=None, shard=0,
                        last_incarnation=2)
    assert not unborn.exists() and report.next_index == 1
    assert any("header was never finished" in cut for cut in report.cut)


def test_queue_takes_and_acknowledgements_replay_and_unacknowledged_leases_come_back(
        tmp_path) -> None:
    """A take for good (no lease) and an acknowledged lease (whole, or its first draws) are
    logged: replayed, those rows stay taken; a lease never acknowledged is not, so its rows
    are in the queue again, in their place. Replay over a checkpoint that saw some of them
    is the same (idempotent)."""
    configs = [TableConfig(name="queue", capacity=100, sampler="fifo")]
    tables = TableSet(configs, LocalIncarnations(0, 1), make_table=LoggedTable)
    log = _log(tmp_path, 1)
    queue = tables["queue"]
    queue.attach(log)
    queue.insert({"x": torch.arange(10)})
    assert queue.sample(2).data["x"].tolist() == [0, 1]  # no lease: taken for good
    assert queue.sample(3, lease=LeaseRequest("a", 60)).data["x"].tolist() == [2, 3, 4]
    assert queue.sample(2, lease=LeaseRequest("b", 60)).data["x"].tolist() == [5, 6]
    checkpoint = queue.state_dict()  # saves leases a and b as given back
    queue.settle_leases(acknowledge=["a"])
    queue.settle_leases(acknowledge_first=("b", 1))  # 5 acknowledged; 6 still leased
    assert queue.sample(1, lease=LeaseRequest("c", 60)).data["x"].tolist() == [7]
    log.close()
    for restored in (None, checkpoint):
        again = TableSet(configs, LocalIncarnations(0, 2), make_table=LoggedTable)
        if restored is not None:
            again["queue"].load_state_dict(restored)
        report = replay_log(tmp_path, again, start=None, start_incarnation=None, shard=0,
                            last_incarnation=1)
        assert report.applied + report.skipped == 4 and not report.cut
        assert again["queue"].size == 4
        assert again["queue"].sample(4).data["x"].tolist() == [6, 7, 8, 9]


def _screens(rng: np.random.Generator, n: int) -> np.ndarray:
    """Atari-like frames: mostly flat, as screens are (lz4 gains)."""
    frames = np.zeros((n, 84, 84, 4), dtype=np.uint8)
    frames[:, 20:40, 10:70] = rng.integers(0, 255, (n, 20, 60, 4), dtype=np.uint8)
    return frames


def test_compressed_columns_are_logged_as_stored_and_replay_bit_exact(tmp_path) -> None:
    """An lz4 column is logged as the blocks the table stored (a fraction of the raw frames),
    a plain one raw; replay gives back the same bytes, bfloat16 included."""
    configs = [TableConfig(name="atari", capacity=100, sampler="uniform",
                           compress_keys=("frame", "value"))]
    tables = TableSet(configs, LocalIncarnations(0, 1), make_table=LoggedTable)
    log = _log(tmp_path, 1)
    tables["atari"].attach(log)
    rng = np.random.default_rng(7)
    raw = 0
    for n in (16, 1, 30):
        frames = _screens(rng, n)
        value = torch.from_numpy(rng.random((n, 3)).astype(np.float32)).to(torch.bfloat16)
        tables["atari"].insert({"frame": frames, "value": value,
                                "reward": rng.random(n).astype(np.float32)})
        raw += frames.nbytes
    log.close()
    logged = (tmp_path / records.segment_name(0)).stat().st_size
    assert logged < raw / 2, (logged, raw)  # the frames' blocks, not the frames
    again = TableSet(configs, LocalIncarnations(0, 2), make_table=LoggedTable)
    report = replay_log(tmp_path, again, start=None, start_incarnation=None, shard=0,
                        last_incarnation=1)
    assert report.applied == 3
    before, after = tables["atari"].state_dict(), again["atari"].state_dict()
    assert before["columns"].keys() == after["columns"].keys() == {"frame", "value", "reward"}
    for key in before["columns"]:
        assert before["columns"][key].dtype == after["columns"][key].dtype
        assert torch.equal(before["columns"][key], after["columns"][key]), key


def test_a_frame_stacked_compressed_table_replays_bit_exact(tmp_path) -> None:
    """A frame-stacked column is logged raw (the table stores only its newest frame), the
    other compressed ones as blocks: replay gives back the same storage."""
    from tests.server.engine.composition import Actors, Combo

    config, _ = Combo("uniform", "memory", True, True, 1).configs(tmp_path, 64, seed=3)
    tables = TableSet([config], LocalIncarnations(0, 1), make_table=LoggedTable)
    log = _log(tmp_path, 1)
    tables["t"].attach(log)
    actors = Actors(3, np.random.default_rng(5))
    for n in (5, 9, 7):
        tables["t"].insert(actors.steps(n))
    log.close()
    again = TableSet([config], LocalIncarnations(0, 2), make_table=LoggedTable)
    assert replay_log(tmp_path, again, start=None, start_incarnation=None, shard=0,
                      last_incarnation=1).applied == 3
    before, after = tables["t"].state_dict(), again["t"].state_dict()
    assert before["columns"].keys() == after["columns"].keys()
    for key in before["columns"]:
        assert torch.equal(before["columns"][key], after["columns"][key]), key


def test_a_group_that_cannot_be_written_fails_its_callers_and_breaks_the_log(tmp_path) -> None:
    """The caller that writes a group (group commit has no writer thread) reports a failure
    to every caller of that group, never leaves them waiting, and the log refuses changes."""
    log = _log(tmp_path, 1)
    good = log.append([b"x"])
    log.wait(good)

    def broken() -> list:
        raise RuntimeError("an encoding bug")

    bad, after = log.append(broken), log.append([b"y"])
    for number in (bad, after):
        with pytest.raises(LogWriteError, match="an encoding bug"):
            log.wait(number)
    with pytest.raises(LogWriteError, match="cannot be written"):
        log.append([b"z"])
    log.close()


def test_a_write_past_the_disk_is_cut_off_and_refuses_changes_until_a_checkpoint(
        tmp_path) -> None:
    """A write that finds the disk full (here: a record larger than the tmpfs, queued past
    the space check) is cut off the segment again, so the log holds no torn record; it fails
    with LogSpaceError naming the log's disk, and further changes are refused (RESOURCE_EXHAUSTED
    in the service) with nothing applied. Replay finds every acknowledged change and no
    damage; a checkpoint (truncate) mends the log."""
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        tables = _tables(1)
        log = _log(disk, 1)
        tables["replay"].attach(log)
        ids = tables["replay"].insert({"obs": torch.ones(3, 5)})
        segment = disk / records.segment_name(0)
        whole = segment.stat().st_size
        number = log.append([b"\1" * (2 << 20)])  # more than the disk holds
        with pytest.raises(LogSpaceError, match=r"disk is full \(.*disk\): No space left on device"):
            log.wait(number)
        assert segment.stat().st_size == whole  # cut off again: no torn record
        with pytest.raises(LogSpaceError, match="nothing of it is stored"):
            tables["replay"].insert({"obs": torch.zeros(2, 5)})
        assert tables["replay"].size == 3
        log.close()
        replayed = _tables(2)
        report = replay_log(disk, replayed, start=None, start_incarnation=None, shard=0,
                            last_incarnation=2)
        assert not report.cut and replayed["replay"].size == 3
        assert replayed["replay"].read_rows(ids=ids).columns["obs"].tolist() == [[1.0] * 5] * 3

        mended = _log(disk, 2, first_index=1)
        with pytest.raises(LogSpaceError):
            mended.wait(mended.append([b"\1" * (2 << 20)]))
        first_kept = mended.rotate()  # what a checkpoint does, then truncates after it
        mended.truncate(first_kept)
        mended.admit(64)  # writes are accepted again
        mended.close()


def test_the_disk_check_refuses_a_change_with_no_room_before_it_is_applied(tmp_path) -> None:
    configs = [TableConfig(name="big", capacity=100_000, sampler="uniform")]
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        tables = TableSet(configs, LocalIncarnations(0, 1), make_table=LoggedTable)
        log = _log(disk, 1)
        tables["big"].attach(log)
        with pytest.raises(LogSpaceError, match=f"no space left on the write-ahead log's disk "
                                                f"\\({disk}"):
            for _ in range(100):  # 20 KB each through a 1 MB disk
                tables["big"].insert({"obs": torch.zeros(1000, 5)})
        assert 10 < tables["big"].log_seq < 100
        assert tables["big"].size == 1000 * tables["big"].log_seq  # the refused: nothing
        log.close()
