"""Restoring tables from the newest usable checkpoint.

Rules, newest checkpoint (by sequence number) first:

* Incomplete or damaged (no COMPLETE marker, a manifest that does not match
  it or does not parse, a file missing, truncated or failing its sha256, a
  state that is malformed): skipped, with a WARNING naming the directory
  and the reason, and the next older one is tried. Only damage falls back.
* A checkpoint that contradicts the config (a table's capacity, sampler,
  slice_len, alpha, episode keys, schema or shard; a table the config no
  longer declares), or that a newer server wrote: a startup error naming
  both values. Skipping it would silently throw its data away.
* Any other failure while loading one (out of memory, more memory than the
  tables may take, a bug): a startup error naming the checkpoint and the
  reason; nothing older is tried.
* Checkpoints exist but every one is damaged: a startup error naming each
  and why (:class:`~replay_server.errors.RestoreError`), unless the operator
  opted in to start empty (``start_empty``), which keeps them on disk.
* Tables the config declares but the checkpoint lacks start empty.
* A checkpoint written without some part (its ``failed_parts``: a table or
  the named variables, see :mod:`~replay_server.checkpoint.writer`) is
  restored, and each missing part is taken from the newest older checkpoint
  that holds it (tables share no invariant); with none, it starts empty. A
  WARNING names the part and where it came from.
* Every file is opened without blocking and must be a regular file: a FIFO
  or a device in a file's place is damage, refused unread (opening a FIFO
  would wait for a writer for ever). A file that cannot be opened for
  another reason (no descriptors left, permissions) is not damage: the
  server does not start (:class:`~replay_server.errors.RestoreError`), as
  for any failure that is not damage.

The checkpoint restored from is marked verified in its directory (partial,
if parts were missing), the damaged ones damaged (a ``DAMAGED`` file in
each, so later starts keep them too): pruning never removes a checkpoint unless newer
verified ones take its place, and never removes a damaged one
(:meth:`~replay_server.checkpoint.directory.CheckpointDirectory.prune`).

Every attempt loads into fresh tables, so a checkpoint that fails half-way
leaves nothing behind. Rows are read from the files straight into table
storage (no second copy in memory), checked against their sha256 as they go.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from replay_server.checkpoint.directory import CheckpointDirectory, CheckpointRef
from replay_server.checkpoint.fileio import (
    RestoreCancelled,
    VerifiedReader,
    read_file,
    read_small,
)
from replay_server.checkpoint.manifest import (
    COMPLETE,
    MANIFEST,
    CorruptCheckpointError,
    FailedPart,
    Manifest,
    NewerFormatError,
    TableEntry,
    check_complete_marker,
)
from replay_server.checkpoint.statecodec import StateFormatError, decode_state
from replay_server.checkpoint.variables_part import read_variables
from replay_server.errors import (
    ConfigError,
    InsufficientMemoryError,
    MalformedStateError,
    RestoreError,
)
from replay_server.engine import (
    DEFAULT_CHUNK_BYTES,
    Table,
    TableSet,
    VariableStore,
    check_saved_config,
)

log = logging.getLogger("replay_server.checkpoint")

MAX_MANIFEST_BYTES = 256 << 20
"""A manifest larger than this is damage (one holds a few bytes per table, state and file)."""


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """The checkpoint tables were restored from, and the ones skipped on the way (with why)."""

    path: Path
    manifest: Manifest
    seconds: float
    skipped: tuple[tuple[Path, str], ...] = ()
    variables: VariableStore | None = None  # restored variables (None: none asked for)


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint at ``path``, checked against its COMPLETE marker.

    Raises:
        CorruptCheckpointError: incomplete, or the manifest is damaged.
        NewerFormatError: written in a format this server cannot read.
    """
    if not (path / COMPLETE).exists():
        raise CorruptCheckpointError(
            f"no {COMPLETE} marker: the checkpoint was never finished") from None
    marker = read_small(path / COMPLETE, COMPLETE, 1024)
    data = read_small(path / MANIFEST, MANIFEST, MAX_MANIFEST_BYTES)
    check_complete_marker(marker, data)
    return Manifest.from_json(data)


def load_checkpoint(
    path: Path, tables: TableSet, cancel: threading.Event | None = None,
    variables: VariableStore | None = None,
) -> Manifest:
    """Load the checkpoint at ``path`` into fresh ``tables`` (a failure leaves them half-loaded),
    and its named variables into a fresh ``variables`` store, if given (none saved: it stays empty).

    Raises:
        CorruptCheckpointError, MalformedStateError: the checkpoint is unusable.
        NewerFormatError: see :func:`read_manifest`.
        ConfigError: the checkpoint contradicts the tables' configs.
        RestoreCancelled: ``cancel`` was set.
    """
    manifest = read_manifest(path)
    unknown = [t.name for t in manifest.tables if t.name not in tables.names]
    if unknown:
        raise ConfigError(
            f"it holds table(s) {unknown} which the config does not declare (tables: "
            f"{tables.names})")
    for entry in manifest.tables:
        load_table(path, entry, tables[entry.name], cancel)
    if variables is not None and manifest.variables is not None:
        read_variables(path, manifest.variables, variables, cancel)
    return manifest


def load_table(path: Path, entry: TableEntry, table: Table,
               cancel: threading.Event | None = None) -> None:
    """Load one table of the checkpoint at ``path`` into ``table`` (unchanged if it fails).

    Raises:
        CorruptCheckpointError, MalformedStateError, ConfigError, RestoreCancelled: see
            :func:`load_checkpoint`.
    """
    blob = read_file(path, entry.state_file, cancel)
    try:
        state = decode_state(entry.state, blob)
    except StateFormatError as exc:
        raise CorruptCheckpointError(f"table {entry.name!r}: {exc}") from None
    if not isinstance(state, dict) or state.get("columns") != {}:
        raise CorruptCheckpointError(f"table {entry.name!r}: the saved state is malformed")
    try:
        written = int(state["ring"]["next_id"]) - int(state["ring"].get("base", 0))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CorruptCheckpointError(
            f"table {entry.name!r}: the saved state has no id counters") from None
    table.load_state_dict(state, read_rows=partial(_read_rows, path, entry, written, cancel))


def _read_rows(
    path: Path, entry: TableEntry, written: int, cancel: threading.Event | None,
    views: dict[str, np.ndarray],
) -> None:
    """Fill a fresh table's columns (``views``; the config already checked) from the files
    (``written``: rows written since the table's last reset)."""
    used = min(written, next(iter(views.values())).shape[0])
    if entry.rows != used:
        raise CorruptCheckpointError(
            f"table {entry.name!r}: the manifest lists {entry.rows} rows but the id counters "
            f"imply {used}")
    keys = [c.key for c in entry.columns]
    if sorted(keys) != sorted(views):
        raise CorruptCheckpointError(
            f"table {entry.name!r}: the manifest has columns {keys}, the saved schema "
            f"{list(views)}")
    for column in entry.columns:
        view = views[column.key]
        capacity = view.shape[0]
        row_bytes = view.itemsize * int(np.prod(view.shape[1:], dtype=np.int64))
        if entry.rows > capacity or (entry.rows and not 0 <= entry.first_slot < capacity):
            raise CorruptCheckpointError(
                f"table {entry.name!r}: {entry.rows} rows from slot {entry.first_slot} do not "
                f"fit a capacity of {capacity}")
        if column.file.nbytes != entry.rows * row_bytes:
            raise CorruptCheckpointError(
                f"table {entry.name!r}: {column.file.name} should hold {entry.rows} rows of "
                f"{row_bytes} bytes, the manifest says {column.file.nbytes} bytes")
        reader = VerifiedReader(path, column.file, cancel)
        try:
            head = min(entry.rows, capacity - entry.first_slot)
            _fill(reader, view, entry.first_slot, head)
            _fill(reader, view, 0, entry.rows - head)
        finally:
            reader.close()
        reader.finish()


def _fill(reader: VerifiedReader, view: Any, start: int, rows: int) -> None:
    """Read the next ``rows`` rows of the file into ``view[start : start + rows]``.

    A numpy view (host storage) is read into directly; any other column (a
    device table's :class:`~replay_server.engine.storage.device.DeviceColumn`)
    through one host buffer of at most :data:`DEFAULT_CHUNK_BYTES`, piece by
    piece, so a restore never holds a whole column on the host.
    """
    if isinstance(view, np.ndarray):
        reader.read_into(view[start : start + rows])
        return
    row_bytes = view.itemsize * int(np.prod(view.shape[1:], dtype=np.int64))
    step = max(1, DEFAULT_CHUNK_BYTES // max(1, row_bytes))
    buffer = np.empty((min(step, rows), *view.shape[1:]), dtype=view.dtype)
    for done in range(0, rows, step):
        n = min(step, rows - done)
        reader.read_into(buffer[:n])
        view[start + done : start + done + n] = buffer[:n]


def restore_latest(
    directory: CheckpointDirectory,
    make_tables: Callable[[], TableSet],
    cancel: threading.Event | None = None,
    make_variables: Callable[[], VariableStore] | None = None,
    *,
    start_empty: bool = False,
) -> tuple[TableSet, RestoreResult] | None:
    """Tables loaded from the newest usable checkpoint in ``directory``, with its named
    variables in ``RestoreResult.variables`` when ``make_variables`` is given.

    Returns ``None`` when there is no checkpoint, or (with ``start_empty``)
    when none is usable.

    Raises:
        ConfigError: the newest usable checkpoint contradicts the config, or
            was written in a newer format; the message names the checkpoint
            and both values.
        RestoreError: every checkpoint is damaged (and not ``start_empty``),
            or loading one failed for another reason; the message names
            each checkpoint and why.
        RestoreCancelled: ``cancel`` was set.
    """
    skipped: list[tuple[Path, str]] = []
    refs = directory.complete()
    for ref in reversed(refs):
        if cancel is not None and cancel.is_set():
            raise RestoreCancelled("restore cancelled")
        start = time.perf_counter()
        tables = make_tables()
        variables = None if make_variables is None else make_variables()
        manifest = _load(directory, ref, refs, tables, cancel, variables, skipped)
        if manifest is None:
            del tables, variables  # dropped before the next attempt makes new ones
            continue
        if manifest.failed:
            older = [r for r in refs if r.sequence < ref.sequence]
            _fill_failed_parts(directory, older, ref.path, manifest, tables, variables, cancel)
            directory.mark_partial(ref.path, {part.describe() for part in manifest.failed})
        else:
            directory.mark_verified(ref.path)
        return tables, RestoreResult(ref.path, manifest, time.perf_counter() - start,
                                     tuple(skipped), variables)
    if refs:
        _none_usable(directory, len(refs), skipped, start_empty)
    return None


def _load(directory: CheckpointDirectory, ref: CheckpointRef, refs: list[CheckpointRef],
          tables: TableSet, cancel: threading.Event | None, variables: VariableStore | None,
          skipped: list[tuple[Path, str]]) -> Manifest | None:
    """Checkpoint ``ref`` loaded into ``tables`` (and ``variables``): its manifest, or
    ``None`` when it is damaged (marked so, logged and added to ``skipped``: the restore
    tries the next older one). Any other failure stops the restore with a message that
    names the checkpoint and what to do (see :func:`restore_latest`)."""
    try:
        return load_checkpoint(ref.path, tables, cancel, variables)
    except (CorruptCheckpointError, MalformedStateError) as exc:
        log.warning("skipping checkpoint %s: %s", ref.path, exc)
        skipped.append((ref.path, str(exc)))
        directory.mark_damaged(ref.path, str(exc))
        return None
    except NewerFormatError as exc:
        raise ConfigError(
            f"checkpoint {ref.path} has {exc}; upgrade the server, or move the checkpoint "
            f"out of the checkpoint directory") from None
    except ConfigError as exc:
        raise ConfigError(_conflict(directory, ref, refs, tables, exc)) from None
    except (InsufficientMemoryError, MemoryError) as exc:
        raise RestoreError(
            f"checkpoint {ref.path} could not be loaded: {type(exc).__name__}"
            f"{': ' if str(exc) else ''}{exc}. The "
            f"server does not start (nothing is thrown away); give it more memory, or "
            f"raise server.table_memory_mb") from None
    except RestoreCancelled:
        raise
    except OSError as exc:  # not damage: the machine (descriptors, permissions, I/O)
        raise RestoreError(
            f"checkpoint {ref.path} could not be read: {exc.strerror or exc} "
            f"({errno.errorcode.get(exc.errno or 0, 'error')}). The server does not "
            f"start (nothing is thrown away); fix the cause and start it again") from None
    except Exception as exc:
        log.error("loading checkpoint %s failed unexpectedly", ref.path, exc_info=exc)
        raise RestoreError(
            f"checkpoint {ref.path} could not be loaded: {type(exc).__name__}: {exc} (the "
            f"log has the traceback). The server does not start (nothing is thrown "
            f"away)") from None


def _none_usable(directory: CheckpointDirectory, count: int, skipped: list[tuple[Path, str]],
                 start_empty: bool) -> None:
    """Every one of the ``count`` checkpoints was damaged: stop the server (RestoreError),
    or with ``start_empty`` say so in the log and let it start with empty tables."""
    reasons = "; ".join(f"{path.name}: {why}" for path, why in skipped)
    if not start_empty:
        raise RestoreError(
            f"none of the {count} checkpoint(s) in {directory.path} can be restored "
            f"({reasons}). The server does not start, so that nothing is lost by mistake: "
            f"repair or move them, or set server.start_empty_if_unrestorable = true (or "
            f"pass --start-empty-if-unrestorable) to start with empty tables; the damaged "
            f"checkpoints are kept either way")
    log.error("none of the %d checkpoint(s) in %s can be restored (%s); starting with "
              "empty tables as server.start_empty_if_unrestorable asks (they are kept)",
              count, directory.path, reasons)


def _fill_failed_parts(
    directory: CheckpointDirectory, older: list[CheckpointRef], path: Path, manifest: Manifest,
    tables: TableSet, variables: VariableStore | None, cancel: threading.Event | None,
) -> None:
    """Load each part ``manifest`` was written without from the newest older checkpoint that
    holds it (tables of one checkpoint share no invariant, so they may come from several)."""
    for part in manifest.failed:
        if part.kind == "variables" and variables is None:
            continue
        if part.kind == "table" and part.name not in tables.names:
            continue
        source = None
        for ref in reversed(older):
            if directory.is_damaged(ref.path):
                continue
            try:
                if _load_part(ref.path, part, tables, variables, cancel):
                    source = ref.path
                    break
            except (CorruptCheckpointError, MalformedStateError, NewerFormatError,
                    ConfigError) as exc:
                log.warning("cannot take %s from older checkpoint %s: %s", part.describe(),
                            ref.path, exc)
        if source is None:
            log.warning("%s was not written into checkpoint %s (%s) and no older checkpoint "
                        "holds it: it starts empty", part.describe(), path, part.error)
        else:
            log.warning("%s was not written into the newest checkpoint (%s): restored from "
                        "the older checkpoint %s", part.describe(), part.error, source)


def _load_part(path: Path, part: FailedPart, tables: TableSet,
               variables: VariableStore | None, cancel: threading.Event | None) -> bool:
    """Load ``part`` from the checkpoint at ``path`` if it holds it; whether it did."""
    manifest = read_manifest(path)
    if any(f.kind == part.kind and f.name == part.name for f in manifest.failed):
        return False
    if part.kind == "variables":
        if manifest.variables is None or variables is None:
            return False
        fresh = VariableStore(variables.max_bytes)
        read_variables(path, manifest.variables, fresh, cancel)
        variables.load(fresh.variables())
        return True
    for entry in manifest.tables:
        if entry.name == part.name:
            load_table(path, entry, tables[part.name], cancel)
            return True
    return False


def _conflict(directory: CheckpointDirectory, ref: CheckpointRef, refs: list[CheckpointRef],
              tables: TableSet, exc: ConfigError) -> str:
    """Why the server refuses to start: every checkpoint in the way, and the two ways out.

    A restore never passes over a checkpoint that contradicts the config (that
    would throw its rows away), so each older one that contradicts it too (by
    its manifest: tables and their saved settings) would stop the next start.
    """
    older = [r for r in reversed(refs) if r.sequence < ref.sequence]
    also = [r.path.name for r in older if _contradicts(r.path, tables)]
    listed = (f"; so do {len(also)} older checkpoint(s): {', '.join(also)}" if also else "")
    move = f"all {len(also) + 1} of them" if also else "it"
    return (f"checkpoint {ref.path} does not fit the config: {exc}{listed}. Two ways out: "
            f"start with the config the checkpoints were written with; or keep this config "
            f"and give it another checkpoint directory (server.checkpoint_dir, or "
            f"--checkpoint-dir), or move {move} out of {directory.path}")


def _contradicts(path: Path, tables: TableSet) -> bool:
    """Whether the manifest at ``path`` names a table ``tables`` lacks, or saved settings that
    contradict a table's config (a damaged manifest: no, a restore would skip it)."""
    try:
        manifest = read_manifest(path)
    except (CorruptCheckpointError, NewerFormatError):
        return False
    for entry in manifest.tables:
        if entry.name not in tables.names:
            return True
        try:
            check_saved_config(tables[entry.name].config, entry.config)
        except ConfigError:
            return True
        except (KeyError, TypeError):
            return False
    return False
