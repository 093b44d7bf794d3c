"""Restore = the newest good checkpoint + a replay of the write-ahead log after it.

The checkpoint's manifest says where its log begins (``wal.segment``, the
segment its writer began just before its snapshots, and ``wal.incarnation``,
the run that wrote it); each table's state says the log sequence number it
covers. :func:`replay_log` first checks every segment from there on, then
applies, table by table in log order, the records each table has not seen:

* segments must follow one another (``wal-…0007.log``, ``…0008``, ...) from
  the checkpoint's first one: a missing segment fails the restore, naming it;
* each segment's header must be this shard's and an incarnation this
  directory gave out (``INCARNATION``), never going back, the first one the
  checkpoint's: a log from another server or incarnation fails the restore;
* a record that is not whole (cut short, or a checksum that does not match)
  at the end of the last segment a run wrote, with no whole record after it,
  is a *torn tail*: those changes were never acknowledged, the file is cut
  at the last whole record and the cut is reported (logged at WARNING, and
  in :class:`ReplayReport`); anywhere else (whole records follow it, or a
  later segment of the same run) it is damage in the middle of the log, and
  the restore fails naming the segment and offset, as a bad checkpoint does;
* a table's records must be numbered without a gap.

Replay is idempotent: it writes nothing but the cut of a torn tail, so a
crash during a replay, then a restart, replays the same log into the same
checkpoint. Replayed inserts keep their ids (each record holds its first id:
:meth:`~replay_server.engine.id_space.IdSpace.follow`), and are admitted
whatever the rate limiter says (it admitted them once; samples are not logged).

Cost: each segment is read twice, one at a time: checked (one CRC32 pass), then applied
from the offsets the check found (no second checksum pass; the records' tensors are views
into the bytes read, so an insert's rows are copied once, into the table).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay_proto.keys import unflatten

from replay_server.checkpoint.fileio import RestoreCancelled
from replay_server.checkpoint.wal import records
from replay_server.checkpoint.wal.logged import LoggedChanges
from replay_server.checkpoint.wal.logged_table import LoggedTable
from replay_server.checkpoint.wal.logged_variables import LoggedVariableStore
from replay_server.engine import TableSet
from replay_server.errors import CorruptLogError, ReplayServerError, UnknownTableError

log = logging.getLogger("replay_server.wal")

_SEGMENT_NAME = re.compile(r"^wal-(\d{16})\.log$")


@dataclass(slots=True)
class ReplayReport:
    """What a replay did: segments read, records applied (and skipped: the checkpoint held
    them), the torn tails cut, and the index the next segment of this run takes."""

    segments: int = 0
    applied: int = 0
    skipped: int = 0
    cut: list[str] = field(default_factory=list)
    next_index: int = 0
    seconds: float = 0.0
    nbytes: int = 0


def find_segments(directory: Path) -> dict[int, Path]:
    """The log segments in ``directory``, by index."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        match = _SEGMENT_NAME.match(name)
        if match:
            found[int(match.group(1))] = directory / name
    return found


def replay_log(directory: Path, tables: TableSet, *, start: int | None,
               start_incarnation: int | None, shard: int, last_incarnation: int,
               cancel: threading.Event | None = None,
               variables: LoggedVariableStore | None = None) -> ReplayReport:
    """Replay the log in ``directory`` into ``tables`` (restored from a checkpoint, or fresh).

    Args:
        start, start_incarnation: where the restored checkpoint's log begins
            (``None``: no checkpoint, or one written without a log: every segment).
        shard: this server's shard.
        last_incarnation: the last incarnation given out before this run's.
        variables: the named variables (restored with the checkpoint), for logged publishes.

    Raises:
        CorruptLogError: a segment is missing, from another server or
            incarnation, or damaged in the middle; a record cannot be replayed.
        RestoreCancelled: ``cancel`` was set.
    """
    began = time.perf_counter()
    found = find_segments(directory)
    report = ReplayReport()
    _drop_unborn_segment(found, report)
    report.next_index = max([*found, (start or 0) - 1]) + 1
    first = start if start is not None else min(found, default=None)
    if first is None:
        return report
    indexes = sorted(i for i in found if i >= first)
    _check_contiguous(directory, first, indexes, start is not None)
    headers = [_header(found[i], i, shard, last_incarnation) for i in indexes]
    _check_incarnations(headers, found, start_incarnation)
    # One buffer for every segment, read into again and again: fresh pages for each
    # segment cost more than the copy (the records' tensors are views into it, and every
    # change copies what it keeps before the next segment is read).
    buffer = bytearray(max(found[i].stat().st_size for i in indexes))
    spans = {}
    for k, index in enumerate(indexes):
        last_of_run = k == len(indexes) - 1 or headers[k + 1].incarnation != headers[k].incarnation
        spans[index] = _check_records(found[index], buffer, last_of_run,
                                      indexes[k + 1] if k + 1 < len(indexes) else None, report)
    for index in indexes:
        _replay_segment(found[index], buffer, spans[index], tables, variables, report, cancel)
    for table in tables:
        table.resume_ids()
    report.seconds = time.perf_counter() - began
    return report


def _replay_segment(path: Path, buffer: bytearray, spans: list[tuple[int, int]],
                    tables: TableSet, variables: LoggedVariableStore | None,
                    report: ReplayReport, cancel: threading.Event | None) -> None:
    """Apply the records of segment ``path`` (at ``spans``: offset and length of each,
    checked already: no second checksum pass), read into ``buffer``."""
    size = _read(path, buffer)
    report.nbytes += size
    view = memoryview(buffer)[:size]
    for offset, length in spans:
        payload = view[offset + records.RECORD_HEADER_BYTES:
                       offset + records.RECORD_HEADER_BYTES + length]
        if cancel is not None and cancel.is_set():
            raise RestoreCancelled("restore cancelled while replaying the log")
        try:
            record = records.decode(payload, offset)
        except records.LogFormatError as exc:
            raise CorruptLogError(f"write-ahead log segment {path}: {exc}") from None
        if record.kind == records.PUBLISH:
            _publish(variables, record, path, report)
        else:
            _apply(tables, record, path, report)
    report.segments += 1


def _drop_unborn_segment(found: dict[int, Path], report: ReplayReport) -> None:
    """The newest segment without a whole header was being created when the server died
    (it never held a record): remove it (reported), so that the next one takes its index."""
    if not found:
        return
    newest = max(found)
    path = found[newest]
    if path.stat().st_size >= records.SEGMENT_HEADER_BYTES:
        return
    message = (f"removed {path}: a write-ahead log segment whose header was never finished "
               f"(the server died creating it; it held no change)")
    log.warning("%s", message)
    path.unlink()
    del found[newest]
    report.cut.append(message)


def _check_contiguous(directory: Path, first: int, indexes: list[int], required: bool) -> None:
    missing = None
    if required and (not indexes or indexes[0] != first):
        missing = first
    else:
        missing = next((i for i, j in zip(range(first, first + len(indexes)), indexes)
                        if i != j), None)
    if missing is None:
        return
    raise CorruptLogError(
        f"write-ahead log segment {records.segment_name(missing)} is missing from {directory} "
        f"(the log from the checkpoint on must be whole; present: "
        f"{[records.segment_name(i) for i in indexes][:8]}); the server does not start, so "
        f"that no acknowledged change is lost by mistake: put it back, or move the log away "
        f"to start from the checkpoint alone")


def _header(path: Path, index: int, shard: int, last_incarnation: int) -> records.SegmentHeader:
    with open(path, "rb") as file:
        head = file.read(records.SEGMENT_HEADER_BYTES)
    try:
        header = records.read_segment_header(head)
    except records.LogFormatError as exc:
        raise CorruptLogError(f"write-ahead log segment {path}: {exc}") from None
    if header.index != index or header.shard != shard:
        raise CorruptLogError(
            f"write-ahead log segment {path} says it is segment {header.index} of shard "
            f"{header.shard}; this is shard {shard}: a log from another server")
    if header.incarnation > last_incarnation:
        raise CorruptLogError(
            f"write-ahead log segment {path} was written by incarnation {header.incarnation}, "
            f"which this directory never gave out (its INCARNATION had reached "
            f"{last_incarnation}): a log from another server or directory")
    return header


def _check_incarnations(headers: list[records.SegmentHeader], found: dict[int, Path],
                        start_incarnation: int | None) -> None:
    if headers and start_incarnation is not None and headers[0].incarnation != start_incarnation:
        raise CorruptLogError(
            f"write-ahead log segment {found[headers[0].index]} was written by incarnation "
            f"{headers[0].incarnation}, but the checkpoint's log begins with incarnation "
            f"{start_incarnation}'s: a log from another incarnation")
    for before, after in zip(headers, headers[1:]):
        if after.incarnation < before.incarnation:
            raise CorruptLogError(
                f"write-ahead log segment {found[after.index]} was written by incarnation "
                f"{after.incarnation}, older than the segment before it "
                f"({before.incarnation}): a log from another incarnation")


def _read(path: Path, buffer: bytearray) -> int:
    """Read a segment into the start of ``buffer`` (writable: the records' tensors are views
    into it, no copy); returns its size."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        view = memoryview(buffer)[:min(size, len(buffer))]
        got = 0
        while got < len(view):
            read = file.readinto(view[got:])
            if not read:
                break
            got += read
    return got


def _check_records(path: Path, buffer: bytearray, last_of_run: bool, next_index: int | None,
                   report: ReplayReport) -> list[tuple[int, int]]:
    """Cut a torn tail (reported); raise CorruptLogError for damage in the middle. Returns
    the whole records' offsets and payload lengths (what replay then applies)."""
    scan = records.scan(buffer, _read(path, buffer))
    spans = [(offset, len(payload)) for offset, payload in scan.records]
    if scan.end == scan.size:
        return spans
    if scan.resumes is not None:
        raise CorruptLogError(
            f"write-ahead log segment {path} is damaged at offset {scan.end} ({scan.problem}) "
            f"and whole records follow at offset {scan.resumes}: damage in the middle of the "
            f"log, whose later changes were acknowledged; the server does not start (nothing "
            f"is thrown away): restore the file, or move the log away to start from the "
            f"checkpoint alone")
    if not last_of_run:
        assert next_index is not None
        raise CorruptLogError(
            f"write-ahead log segment {path} ends at offset {scan.end} in {scan.problem}, but "
            f"segment {records.segment_name(next_index)} of the same run follows it: damage "
            f"in the middle of the log; the server does not start (nothing is thrown away)")
    message = (f"cut the write-ahead log's torn tail: {scan.size - scan.end} bytes at offset "
               f"{scan.end} of {path} ({scan.problem}); the changes there were never "
               f"acknowledged")
    log.warning("%s", message)
    os.truncate(path, scan.end)
    report.cut.append(message)
    return spans


def _apply(tables: TableSet, record: records.Record, path: Path, report: ReplayReport) -> None:
    where = f"{records.KIND_NAMES[record.kind]} record at offset {record.offset} of {path}"
    name = record.meta.get("table")
    try:
        table = tables[str(name)]
    except UnknownTableError:
        raise CorruptLogError(f"the {where} changes table {name!r}, which the config does not "
                              f"declare (tables: {tables.names})") from None
    if not isinstance(table, LoggedTable):
        raise CorruptLogError(f"the {where} cannot be replayed into table {name!r}")
    _in_order(table, record, where, f"table {name!r}", report, lambda: _change(table, record))


def _publish(store: LoggedVariableStore | None, record: records.Record, path: Path,
             report: ReplayReport) -> None:
    where = f"publish record at offset {record.offset} of {path}"
    if store is None:
        raise CorruptLogError(f"the {where} cannot be replayed: no named variables to replay into")
    _in_order(store, record, where, "the variables", report, lambda: store.replayed(
        int(record.meta["version"]), str(record.meta["name"]),
        record.tensors["layout"].numpy().tobytes(), record.tensors["data"].numpy().copy()))


def _in_order(target: LoggedChanges, record: records.Record, where: str, what: str,
              report: ReplayReport, apply: Callable[[], Any]) -> None:
    """Apply ``record`` to ``target`` if it is the target's next change; skip it if the
    checkpoint holds it already."""
    if not target.replays(record.meta.get("seq"), where, what):
        report.skipped += 1
        return
    try:
        apply()
    except (ReplayServerError, ValueError, KeyError) as exc:
        raise CorruptLogError(f"the {where} cannot be replayed: {exc}") from None
    target.replayed_one()
    report.applied += 1


def _change(table: LoggedTable, record: records.Record) -> None:
    tensors = record.tensors
    if record.kind == records.INSERT:
        first_id = int(record.meta["first_id"])
        columns = {key[2:]: value for key, value in tensors.items() if key.startswith("c:")}
        for key, (dtype, shape) in record.meta.get("z", {}).items():  # compressed columns
            columns[key] = records.unpacked_rows(tensors[f"z:{key}"], dtype, shape,
                                                 int(record.meta["rows"]))
        given = tensors.get("priorities")
        ids = table.replay_insert(unflatten(columns), None if given is None else given.numpy(),
                                  first_id)
        if int(ids[0]) != first_id:
            raise ValueError(f"its rows got id {int(ids[0])}, the log says {first_id}")
    elif record.kind == records.PRIORITIES:
        table.update_priorities(tensors["ids"].numpy(), tensors["priorities"].numpy())
    elif record.kind == records.RESET:
        table.reset(schema=bool(record.meta.get("schema")))
    elif record.kind == records.DELETE:
        table.delete(tensors["ids"].numpy())
    elif record.kind == records.TAKE:
        table.retire(tensors["ids"].numpy())
    else:
        raise ValueError(f"a record of kind {record.kind} belongs to no table")
