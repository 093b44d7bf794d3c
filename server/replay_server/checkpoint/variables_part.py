"""The named variables' part of a checkpoint: ``variables.bin`` plus an entry in the manifest.

Layout 2 (written now): ``variables.bin`` holds, per variable, its encoded
specs then its tensors' bytes (each 64-byte aligned), exactly as the
:class:`~replay_server.engine.variables.VariableStore` holds them, so
saving and restoring a variable of a million keys builds no object per key.
The manifest keeps, under ``"variables"``, the layout version and per
variable its name, version and where its two pieces lie in the file
(``{"offset", "nbytes"}``). The file is hashed like every other.

Layout 1 (read still): the store's
:meth:`~replay_server.engine.variables.VariableStore.state_dict` encoded by
:mod:`~replay_server.checkpoint.statecodec` (a tensor reference per key).

Checkpoints written before variables existed have no such entry and restore
with no variables; a part in a layout this server cannot read, or a damaged
one, makes the whole checkpoint unusable (it is skipped like any damaged
checkpoint).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from replay_server.checkpoint.wal.logged_table import LOG_SEQ_KEY
from replay_server.checkpoint.wal.logged_variables import LoggedVariableStore
from replay_server.checkpoint.fileio import read_file, write_file
from replay_server.checkpoint.manifest import (
    VARIABLES_FILE,
    CorruptCheckpointError,
    VariablesEntry,
)
from replay_server.checkpoint.statecodec import StateFormatError, decode_state
from replay_server.engine import VARIABLES_STATE_VERSION, Variable, VariableStore
from replay_server.errors import MalformedStateError

PACKED_VERSION = 2
"""The layout written now (see the module docstring)."""

_ALIGN = 64


def write_variables(root: Path, store: VariableStore) -> VariablesEntry:
    """Write ``store``'s variables into the checkpoint being written at ``root``.

    Raises:
        OSError: the file could not be written (the writer turns it into a checkpoint error).
    """
    pieces: list[np.ndarray] = []
    offset = 0

    def add(data: np.ndarray) -> dict[str, int]:
        nonlocal offset
        ref = {"offset": offset, "nbytes": int(data.nbytes)}
        pieces.append(data)
        offset += data.nbytes
        pad = -offset % _ALIGN
        if pad:
            pieces.append(np.zeros(pad, dtype=np.uint8))
            offset += pad
        return ref

    covered = None  # a logged store: the write-ahead log's publishes these hold
    if isinstance(store, LoggedVariableStore):
        variables, covered = store.snapshot()
    else:
        variables = store.variables()
    entries = [{"name": v.name, "version": v.version,
                "layout": add(np.frombuffer(v.layout, dtype=np.uint8)), "data": add(v.data)}
               for v in variables]
    state: dict[str, Any] = {"variables": entries}
    if covered is not None:
        state[LOG_SEQ_KEY] = covered
    return VariablesEntry(version=PACKED_VERSION, state=state,
                          file=write_file(root, VARIABLES_FILE, *pieces))


def read_variables(path: Path, entry: VariablesEntry, store: VariableStore,
                   cancel: threading.Event | None = None) -> None:
    """Load the variables of the checkpoint at ``path`` into a fresh ``store``.

    Raises:
        CorruptCheckpointError: the file fails its checks, or the state is malformed
            or of a layout version this server cannot read.
    """
    if entry.version not in (VARIABLES_STATE_VERSION, PACKED_VERSION):
        raise CorruptCheckpointError(
            f"variables: layout version {entry.version}, this server reads "
            f"{VARIABLES_STATE_VERSION} and {PACKED_VERSION}")
    blob = read_file(path, entry.file, cancel)
    try:
        if entry.version == VARIABLES_STATE_VERSION:
            store.load_state_dict(decode_state(entry.state, blob))
        else:
            store.load(_packed(entry.state, blob))
            if isinstance(store, LoggedVariableStore):
                store.log_seq = int(entry.state.get(LOG_SEQ_KEY, 0))
    except (StateFormatError, MalformedStateError) as exc:
        raise CorruptCheckpointError(f"variables: {exc}") from None


def _packed(state: Any, blob: np.ndarray) -> list[Variable]:
    """The variables of a layout-2 part (each piece copied out of ``blob``)."""

    def piece(ref: Any) -> np.ndarray:
        offset, nbytes = int(ref["offset"]), int(ref["nbytes"])
        if offset < 0 or nbytes < 0 or offset + nbytes > blob.size:
            raise ValueError(f"a piece of {nbytes} bytes at {offset} lies outside the "
                             f"{blob.size}-byte file")
        return blob[offset : offset + nbytes].copy()

    try:
        return [VariableStore.restored(item["name"], int(item["version"]),
                                       piece(item["layout"]).tobytes(), piece(item["data"]))
                for item in state["variables"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedStateError(f"the saved variables are malformed: {exc}") from None
