"""Writing one checkpoint of a set of tables (layout: manifest.py and directory.py).

Each table is snapshotted at its own instant (:meth:`Table.snapshot
<replay_server.engine.table.Table.snapshot>`: a short lock hold), then its rows are
streamed to the column files piece by piece while the table keeps serving.
Tables are written one after another; no invariant spans tables.

**Parts.** Each table, and the named variables, is one *part*. A part that
fails for a reason of its own (its state cannot be encoded: a bug, or a value
no checkpoint can hold) is left out, and the others are written: the
manifest lists it under ``failed_parts`` with the error, the result's
:attr:`CheckpointResult.failed` names it, and a restore takes that part from
an older checkpoint (:mod:`~replay_server.checkpoint.reader`). One bad part
never costs the tables their checkpoint.

A failure of the disk (any ``OSError``: a full disk, a quota, a file-size
limit, an I/O error, the directory gone) concerns every part: it removes the
temporary directory and raises
:class:`~replay_server.errors.CheckpointWriteError` (or its
:class:`~replay_server.errors.CheckpointSpaceError` for a full disk, a quota
or a file-size limit) naming the file and the cause. The tables are never
affected by a failed checkpoint.

A committed checkpoint is read back (its manifest against COMPLETE, every
file's size against the manifest) before it counts as verified; only then
may older checkpoints be pruned for it (see
:meth:`~replay_server.checkpoint.directory.CheckpointDirectory.prune`).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replay_server.checkpoint.directory import CheckpointDirectory
from replay_server.checkpoint.wal.log import WriteAheadLog
from replay_server.checkpoint.fileio import HashedWriter, write_file
from replay_server.checkpoint.manifest import (
    COMPLETE,
    MANIFEST,
    VARIABLES_FILE,
    ColumnEntry,
    FailedPart,
    Manifest,
    TableEntry,
    VariablesEntry,
    complete_marker,
)
from replay_server.checkpoint.statecodec import encode_state
from replay_server.checkpoint.variables_part import write_variables
from replay_server.errors import CheckpointSpaceError, CheckpointWriteError
from replay_server.engine import DEFAULT_CHUNK_BYTES, Table, VariableStore

_SPACE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

log = logging.getLogger("replay_server.checkpoint")


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    """A checkpoint that was written: where, what, how big and how long it took."""

    path: Path
    sequence: int
    created: str
    nbytes: int
    seconds: float
    tables: dict[str, int]  # table name -> rows saved (slots ever written)
    removed: tuple[Path, ...] = ()  # older checkpoints pruned after it
    failed: tuple[FailedPart, ...] = ()  # parts written without (see the module docstring)

    @property
    def complete(self) -> bool:
        """Whether every part was written."""
        return not self.failed

    @property
    def lost_tables(self) -> bool:
        """Whether a table's part failed (not only the variables)."""
        return any(part.kind == "table" for part in self.failed)

    @classmethod
    def of(cls, manifest: Manifest, path: Path, seconds: float,
           removed: tuple[Path, ...]) -> CheckpointResult:
        """The result of a checkpoint whose ``manifest`` was written at ``path``."""
        return cls(path=path, sequence=manifest.sequence, created=manifest.created,
                   nbytes=manifest.nbytes, seconds=seconds,
                   tables={t.name: t.rows for t in manifest.tables}, removed=removed,
                   failed=manifest.failed)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def write_checkpoint(
    tables: Iterable[Table],
    directory: CheckpointDirectory,
    *,
    keep_latest: int,
    server_version: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    variables: VariableStore | None = None,
    log: WriteAheadLog | None = None,
) -> CheckpointResult:
    """Write a checkpoint of ``tables`` (and ``variables``) into ``directory``, then prune old ones.

    With a write-ahead ``log``: a new segment is begun before the first snapshot (the
    manifest records it: the log after the checkpoint begins there), and once the
    checkpoint is complete and read back, the segments before it are deleted.

    Raises:
        CheckpointWriteError: the checkpoint could not be written (nothing of
            it remains); CheckpointSpaceError when space ran out.
    """
    start = time.perf_counter()
    created_unix = time.time()
    temp: Path | None = None
    current = [str(directory.path)]  # what was being written, for the error message
    failed: list[FailedPart] = []
    try:
        sequence, temp, final = directory.begin()
        wal = None
        if log is not None:
            current[0] = f"the write-ahead log in {log.directory}"
            wal = (log.rotate(), log.incarnation)
        entries, saved_variables = _write_parts(directory, temp, tables, variables,
                                                chunk_bytes, current, failed)
        manifest = Manifest(
            server_version=server_version,
            created=_created(created_unix),
            created_unix=created_unix,
            sequence=sequence,
            tables=tuple(entries),
            variables=saved_variables,
            failed=tuple(failed),
            wal=wal,
        )
        data = _write_manifest(temp, manifest, current)
        current[0] = str(final)
        directory.commit(temp, final)
        temp = final  # removed again if it does not read back as written
        _verify(final, data, manifest)
        temp = None
        _mark(directory, final, manifest)
    except OSError as exc:
        raise _write_error(exc, current[0]) from exc
    finally:
        if temp is not None:
            directory.discard(temp)
    removed = tuple(directory.prune(keep_latest))
    if log is not None and wal is not None and not failed:  # a part missing: kept for it
        log.truncate(wal[0])
    return CheckpointResult.of(manifest, final, time.perf_counter() - start, removed)


def _created(unix: float) -> str:
    """``unix`` as a manifest's ``created``: UTC, ISO 8601, to the millisecond."""
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix))
            + f".{int(unix * 1000) % 1000:03d}Z")


def _mark(directory: CheckpointDirectory, final: Path, manifest: Manifest) -> None:
    """Mark a checkpoint that read back as written: verified (older ones may be pruned for
    it), or partial, naming the parts it was written without."""
    if manifest.complete:
        directory.mark_verified(final)
    else:
        directory.mark_partial(final, {part.describe() for part in manifest.failed})


def _write_error(exc: OSError, what: str) -> CheckpointWriteError:
    """The typed error for a failure of the disk while writing ``what``
    (:class:`~replay_server.errors.CheckpointSpaceError` when space ran out)."""
    kind = CheckpointSpaceError if exc.errno in _SPACE_ERRORS else CheckpointWriteError
    name = errno.errorcode.get(exc.errno or 0, "error")
    return kind(f"checkpoint failed writing {what}: {exc.strerror or exc} ({name}); the "
                f"tables are unaffected and keep serving")


def _write_manifest(temp: Path, manifest: Manifest, current: list[str]) -> bytes:
    """Write ``manifest`` into ``temp``, then the marker that completes the checkpoint (the
    manifest's digest: a checkpoint without it, or whose marker does not match, is never
    loaded); the manifest's bytes. ``current[0]``: the file being written."""
    data = manifest.to_json()
    current[0] = str(temp / MANIFEST)
    write_file(temp, MANIFEST, np.frombuffer(data, dtype=np.uint8))
    current[0] = str(temp / COMPLETE)
    write_file(temp, COMPLETE, np.frombuffer(complete_marker(data), dtype=np.uint8))
    return data


def _write_parts(directory: CheckpointDirectory, temp: Path, tables: Iterable[Table],
                 variables: VariableStore | None, chunk_bytes: int, current: list[str],
                 failed: list[FailedPart]) -> tuple[list[TableEntry], VariablesEntry | None]:
    """Each table's part, then the variables', into ``temp``: their manifest entries. A part
    whose own state fails is left out (added to ``failed``, its files removed) and the others
    are written; an OSError (the disk) fails the whole checkpoint."""
    entries = []
    for table in tables:
        try:
            entries.append(_write_table(temp, table, chunk_bytes, current))
        except OSError:
            raise
        except Exception as exc:  # this table's own state: the others are written
            failed.append(_left_out("table", table.name, exc))
            directory.discard(temp / table.name)
    current[0] = str(temp / VARIABLES_FILE)
    saved_variables = None
    if variables is not None:
        try:
            saved_variables = write_variables(temp, variables)
        except OSError:
            raise
        except Exception as exc:
            failed.append(_left_out("variables", "", exc))
            (temp / VARIABLES_FILE).unlink(missing_ok=True)
    return entries, saved_variables


def _left_out(kind: str, name: str, exc: Exception) -> FailedPart:
    """The record of a part left out of a checkpoint (logged with its traceback: a bug, mostly)."""
    part = FailedPart(kind, name, f"{type(exc).__name__}: {exc}"[:2000])
    log.error("checkpoint: %s could not be written, the other parts are", part.describe(),
              exc_info=exc)
    return part


def _verify(path: Path, data: bytes, manifest: Manifest) -> None:
    """Read back what a committed checkpoint's files say; raise OSError if anything differs."""
    if (path / MANIFEST).read_bytes() != data or (path / COMPLETE).read_bytes() != complete_marker(
            data):
        raise OSError(errno.EIO, f"{path} reads back differently from what was written")
    for entry in manifest.tables:
        for file in (entry.state_file, *(column.file for column in entry.columns)):
            size = (path / file.name).stat().st_size
            if size != file.nbytes:
                raise OSError(errno.EIO, f"{path / file.name} reads back {size} bytes, "
                                         f"{file.nbytes} were written")


def _write_table(root: Path, table: Table, chunk_bytes: int, current: list[str]) -> TableEntry:
    (root / table.name).mkdir(mode=0o700)
    with table.snapshot(chunk_bytes) as snap:
        state = snap.state
        schema = state["schema"]
        rows = snap.rows
        columns: list[ColumnEntry] = []
        if rows is not None and schema is not None:
            keys = list(schema)
            writers = [HashedWriter(root, f"{table.name}/column-{i}.bin") for i in range(len(keys))]
            try:
                for piece in rows.pieces():
                    for key, writer in zip(keys, writers):
                        current[0] = str(writer.path)
                        writer.write(piece.columns[key])
                for key, writer in zip(keys, writers):
                    current[0] = str(writer.path)
                    spec = schema[key]
                    columns.append(ColumnEntry(key, spec["dtype"], tuple(spec["shape"]),
                                               writer.finish()))
            finally:
                for writer in writers:
                    writer.close()
        used = 0 if rows is None else rows.used
        first_slot = 0 if rows is None else rows.first_slot
    tree, blob = encode_state(state)
    current[0] = str(root / table.name / "state.bin")
    state_file = write_file(root, f"{table.name}/state.bin", *blob)
    return TableEntry(
        name=table.name, config=state["config"],
        schema=None if schema is None else {
            k: f"{v['dtype']}{list(v['shape'])}" for k, v in schema.items()},
        rows=used, first_slot=first_slot, columns=tuple(columns), state_file=state_file,
        state=tree,
    )
