"""The named variables' part of a checkpoint: ``variables.bin`` plus an entry in the manifest.

The store's :meth:`~replay_server.engine.variables.VariableStore.state_dict`
(names, versions, keys, tensors: no pickle) is encoded by
:mod:`~replay_server.checkpoint.statecodec` into a JSON tree, kept in the
manifest under ``"variables"`` with the layout version, and one blob file,
``variables.bin``, hashed like every other file. Checkpoints written before
variables existed have no such entry and restore with no variables; a part
in a layout this server cannot read, or a damaged one, makes the whole
checkpoint unusable (it is skipped like any damaged checkpoint).
"""

from __future__ import annotations

import threading
from pathlib import Path

from replay_server.checkpoint.fileio import read_file, write_file
from replay_server.checkpoint.manifest import (
    VARIABLES_FILE,
    CorruptCheckpointError,
    VariablesEntry,
)
from replay_server.checkpoint.statecodec import StateFormatError, decode_state, encode_state
from replay_server.engine.variables import STATE_VERSION, VariableStore
from replay_server.errors import MalformedStateError


def write_variables(root: Path, store: VariableStore) -> VariablesEntry:
    """Write ``store``'s variables into the checkpoint being written at ``root``.

    Raises:
        OSError: the file could not be written (the writer turns it into a checkpoint error).
    """
    tree, blob = encode_state(store.state_dict())
    return VariablesEntry(version=STATE_VERSION, state=tree,
                          file=write_file(root, VARIABLES_FILE, *blob))


def read_variables(path: Path, entry: VariablesEntry, store: VariableStore,
                   cancel: threading.Event | None = None) -> None:
    """Load the variables of the checkpoint at ``path`` into a fresh ``store``.

    Raises:
        CorruptCheckpointError: the file fails its checks, or the state is malformed
            or of a layout version this server cannot read.
    """
    if entry.version != STATE_VERSION:
        raise CorruptCheckpointError(
            f"variables: layout version {entry.version}, this server reads {STATE_VERSION}")
    blob = read_file(path, entry.file, cancel)
    try:
        store.load_state_dict(decode_state(entry.state, blob))
    except (StateFormatError, MalformedStateError) as exc:
        raise CorruptCheckpointError(f"variables: {exc}") from None
