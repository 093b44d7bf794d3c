"""A checkpoint's manifest: what it holds, in versioned JSON, and how that is checked.

One checkpoint is one directory::

    ckpt-20261121T212800.123Z-000007/
        manifest.json         this module's Manifest, as JSON
        COMPLETE              "sha256 <hex of manifest.json>  manifest.json", written last
        <table>/state.bin     the table's state arrays (see statecodec)
        <table>/column-<i>.bin  the rows of column i: raw little-endian, C order,
                              oldest row first (row 0 sits in slot first_slot)
        variables.bin         the named variables' tensors (optional part, see
                              checkpoint.variables_part; older checkpoints lack it)

``manifest.json`` records the format version, the server version and the
time, the parts that could not be written (``failed_parts``: a table or the
variables, with the error; absent when every part was), and per table: its config, schema, the rows saved and where they go,
the state tree (statecodec), and every file's name, size and sha256.

Parsing is strict: anything missing or of the wrong type is a
:class:`CorruptCheckpointError` naming what (a checkpoint whose manifest
cannot be trusted is skipped, never half-used).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

FORMAT = "replay-server-checkpoint"
FORMAT_VERSION = 1
"""Bumped on any change older servers cannot read."""

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
_COMPLETE_LINE = re.compile(r"^sha256 ([0-9a-f]{64})  manifest\.json\n$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,128}/[a-z0-9\-]{1,64}\.bin$")
VARIABLES_FILE = "variables.bin"


class CorruptCheckpointError(Exception):
    """A checkpoint on disk is incomplete or damaged; the message says how. It is skipped."""


class NewerFormatError(Exception):
    """A checkpoint was written in a format version this server cannot read."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint, size and sha256 (hex)."""

    name: str
    nbytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.nbytes, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class ColumnEntry:
    """One column: flat key, dtype name, per-row shape, and its file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    file: FileEntry

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
                "file": self.file.to_json()}


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One table: config and schema (as saved), rows saved, files and state tree.

    ``rows`` is the number of slots ever written (all saved); file row ``i``
    belongs in slot ``(first_slot + i) % capacity``.
    """

    name: str
    config: dict[str, Any]
    schema: dict[str, str] | None
    rows: int
    first_slot: int
    columns: tuple[ColumnEntry, ...]
    state_file: FileEntry
    state: Any

    @property
    def nbytes(self) -> int:
        return self.state_file.nbytes + sum(c.file.nbytes for c in self.columns)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config, "schema": self.schema,
                "rows": self.rows, "first_slot": self.first_slot,
                "columns": [c.to_json() for c in self.columns],
                "state_file": self.state_file.to_json(), "state": self.state}


@dataclass(frozen=True, slots=True)
class VariablesEntry:
    """The named variables: their layout version, state tree (statecodec) and file."""

    version: int
    state: Any
    file: FileEntry

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "state": self.state, "file": self.file.to_json()}


@dataclass(frozen=True, slots=True)
class FailedPart:
    """A part a checkpoint was written without: ``kind`` ``"table"`` (``name`` the table's)
    or ``"variables"``, and the error that kept it out."""

    kind: str
    name: str
    error: str

    def describe(self) -> str:
        return f"table {self.name!r}" if self.kind == "table" else "the named variables"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "error": self.error}


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a checkpoint holds. See the module docstring."""

    server_version: str
    created: str  # ISO 8601, UTC
    created_unix: float
    sequence: int
    tables: tuple[TableEntry, ...]
    format_version: int = FORMAT_VERSION
    variables: VariablesEntry | None = None
    failed: tuple[FailedPart, ...] = ()
    """Parts that could not be written (the rest was): restore takes them from an older
    checkpoint (see :mod:`~replay_server.checkpoint.reader`)."""
    wal: tuple[int, int] | None = None
    """Where the write-ahead log after this checkpoint begins: (segment index, incarnation of
    the run that wrote both); ``None``: written without a log."""

    @property
    def complete(self) -> bool:
        """Whether every part was written."""
        return not self.failed

    @property
    def nbytes(self) -> int:
        """Bytes of all data files (the manifest itself not counted)."""
        return sum(t.nbytes for t in self.tables)

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "format_version": self.format_version,
            "server_version": self.server_version, "created": self.created,
            "created_unix": self.created_unix, "sequence": self.sequence,
            "byteorder": "little", "tables": [t.to_json() for t in self.tables],
            **({} if self.variables is None else {"variables": self.variables.to_json()}),
            **({"failed_parts": [f.to_json() for f in self.failed]} if self.failed else {}),
            **({} if self.wal is None else {
                "wal": {"segment": self.wal[0], "incarnation": self.wal[1]}}),
        }, indent=1, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and check a manifest.

        Raises:
            CorruptCheckpointError: not a manifest, or a field is missing or wrong.
            NewerFormatError: a format version this server cannot read.
        """
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{MANIFEST} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{MANIFEST} is not a {FORMAT} manifest")
        version = _get(doc, "format_version", int, "manifest")
        if version != FORMAT_VERSION:
            raise NewerFormatError(
                f"format version {version}; this server reads version {FORMAT_VERSION}")
        if _get(doc, "byteorder", str, "manifest") != "little":
            raise CorruptCheckpointError(f"{MANIFEST}: only little-endian data is supported")
        tables = _get(doc, "tables", list, "manifest")
        entries = tuple(_table(t, f"tables[{i}]") for i, t in enumerate(tables))
        names = [t.name for t in entries]
        if len(set(names)) != len(names):
            raise CorruptCheckpointError(f"{MANIFEST}: a table is listed twice: {names}")
        return cls(
            server_version=_get(doc, "server_version", str, "manifest"),
            created=_get(doc, "created", str, "manifest"),
            created_unix=float(_get(doc, "created_unix", (int, float), "manifest")),
            sequence=_get(doc, "sequence", int, "manifest"),
            tables=entries,
            format_version=version,
            variables=_variables(doc["variables"]) if "variables" in doc else None,
            failed=_failed(doc.get("failed_parts", [])),
            wal=_wal(doc["wal"]) if "wal" in doc else None,
        )


def complete_marker(manifest_bytes: bytes) -> bytes:
    """The COMPLETE file's content for a manifest."""
    return f"sha256 {hashlib.sha256(manifest_bytes).hexdigest()}  {MANIFEST}\n".encode()


def check_complete_marker(marker: bytes, manifest_bytes: bytes) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``marker`` vouches for ``manifest_bytes``."""
    match = _COMPLETE_LINE.match(marker.decode("ascii", errors="replace"))
    if match is None:
        raise CorruptCheckpointError(f"{COMPLETE} marker is malformed: {marker[:100]!r}")
    if match.group(1) != hashlib.sha256(manifest_bytes).hexdigest():
        raise CorruptCheckpointError(
            f"{MANIFEST} does not match the sha256 recorded in {COMPLETE} (damaged manifest)")


def _table(doc: Any, where: str) -> TableEntry:
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{MANIFEST}: {where} is not an object")
    name = _get(doc, "name", str, where)
    where = f"table {name!r}"
    schema = doc.get("schema")
    if schema is not None and not (
        isinstance(schema, dict) and all(isinstance(v, str) for v in schema.values())
    ):
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: schema is malformed")
    columns = _get(doc, "columns", list, where)
    entries = []
    for i, column in enumerate(columns):
        if not isinstance(column, dict):
            raise CorruptCheckpointError(f"{MANIFEST}: {where}: columns[{i}] is not an object")
        shape = _get(column, "shape", list, f"{where} columns[{i}]")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptCheckpointError(f"{MANIFEST}: {where}: columns[{i}] shape is malformed")
        entries.append(ColumnEntry(
            key=_get(column, "key", str, f"{where} columns[{i}]"),
            dtype=_get(column, "dtype", str, f"{where} columns[{i}]"),
            shape=tuple(shape),
            file=_file(column.get("file"), f"{where} columns[{i}]"),
        ))
    rows, first_slot = _get(doc, "rows", int, where), _get(doc, "first_slot", int, where)
    if rows < 0 or first_slot < 0:
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: rows and first_slot must be >= 0")
    if "state" not in doc:
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: 'state' is missing")
    return TableEntry(
        name=name, config=_get(doc, "config", dict, where), schema=schema, rows=rows,
        first_slot=first_slot, columns=tuple(entries),
        state_file=_file(doc.get("state_file"), f"{where} state_file"), state=doc["state"],
    )


def _variables(doc: Any) -> VariablesEntry:
    if not isinstance(doc, dict) or "state" not in doc:
        raise CorruptCheckpointError(f"{MANIFEST}: variables: not an object with a state")
    entry = VariablesEntry(version=_get(doc, "version", int, "variables"), state=doc["state"],
                           file=_file(doc.get("file"), "variables"))
    if entry.file.name != VARIABLES_FILE:
        raise CorruptCheckpointError(
            f"{MANIFEST}: variables: file name {entry.file.name!r} is not allowed")
    return entry


def _failed(doc: Any) -> tuple[FailedPart, ...]:
    if not isinstance(doc, list):
        raise CorruptCheckpointError(f"{MANIFEST}: failed_parts is not a list")
    parts = []
    for i, item in enumerate(doc):
        where = f"failed_parts[{i}]"
        if not isinstance(item, dict):
            raise CorruptCheckpointError(f"{MANIFEST}: {where} is not an object")
        part = FailedPart(_get(item, "kind", str, where), _get(item, "name", str, where),
                          _get(item, "error", str, where))
        if part.kind not in ("table", "variables"):
            raise CorruptCheckpointError(f"{MANIFEST}: {where}: unknown kind {part.kind!r}")
        parts.append(part)
    return tuple(parts)


def _wal(doc: Any) -> tuple[int, int]:
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{MANIFEST}: wal must be an object, got {doc!r}")
    return _get(doc, "segment", int, "wal"), _get(doc, "incarnation", int, "wal")


def _file(doc: Any, where: str) -> FileEntry:
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: file entry is missing")
    name = _get(doc, "name", str, where)
    if not (_FILE_NAME.match(name) or name == VARIABLES_FILE):
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: file name {name!r} is not allowed")
    digest = _get(doc, "sha256", str, where)
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: sha256 {digest!r} is malformed")
    nbytes = _get(doc, "bytes", int, where)
    if nbytes < 0:
        raise CorruptCheckpointError(f"{MANIFEST}: {where}: bytes must be >= 0")
    return FileEntry(name, nbytes, digest)


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CorruptCheckpointError(
            f"{MANIFEST}: {where}: {key!r} is missing or not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"int": "an integer", "str": "a string", "dict": "an object",
                        "list": "a list", "float": "a number"}[k.__name__] for k in kinds)
