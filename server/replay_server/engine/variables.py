"""Named variables: versioned state dicts (tensors only) that a learner publishes to its actors.

A variable is a name, a version and a flat mapping of string keys (a state
dict's keys, dots included, taken as they are) to CPU tensors. Each publish
of a name stores a private copy as the next version (1, 2, ...) and drops
the previous one: only the newest is kept. Versions never go back, not even
across a checkpoint and restore (the store is part of checkpoints).

**Held packed, charged what it holds.** A stored variable is two objects,
whatever its number of keys: its tensors' bytes in one buffer, and their
specs (key, dtype, shape) encoded once (:func:`replay_proto.variable_codec.encode_layout`),
which is also what a fetch sends, so a fetch copies the buffer once and
builds nothing per key. A variable is charged its buffer, its encoded specs
and :data:`VARIABLE_OVERHEAD_BYTES` (the objects around them), which is what
it holds; a tensor per key (hundreds of bytes each: the earlier layout)
exists only while a caller reads :attr:`Variable.tensors`.

Bounded: all variables together are charged at most ``max_bytes``; a publish
past that is refused whole with :class:`~replay_server.errors.VariableBudgetError`,
and what was stored before stays. Bad input (an empty or malformed name, no
tensors, an empty, repeated or overlong key, more than
:data:`~replay_proto.variable_codec.MAX_DIMS` dimensions, a dtype no table
could store) is refused with :class:`~replay_server.errors.InvalidVariableError`
naming what was wrong, before anything is stored: whatever is accepted can
be checkpointed.

This is how a policy that cannot be pickled or deep-copied reaches its
actors: only its tensors travel (no pickle, the tensor codec's raw bytes).

Thread-safety: every method may be called from any thread; one lock guards
the mapping, held only to swap or read references (copies happen outside it).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay_proto.codec import CodecError, decode_tensor_list, encode_tensors
from replay_proto.scalars import is_int
from replay_proto.v1 import replay_pb2 as pb
from replay_proto.variable_codec import (
    VariableFormatError,
    check_specs,
    check_state,
    decode_layout,
    encode_layout,
)
from replay_server.errors import (
    InvalidVariableError,
    MalformedStateError,
    UnknownVariableError,
    VariableBudgetError,
)

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,127}")
"""Variable names: 1-128 letters, digits, ``_``, ``.``, ``-`` or ``/``, not starting with
``.``, ``-`` or ``/``."""

VARIABLE_OVERHEAD_BYTES = 1024
"""What each stored variable is charged beyond its buffer and encoded specs (the objects
holding them, its name, its entry in the store)."""

STATE_VERSION = 1
"""Layout version of :meth:`VariableStore.state_dict` (checkpoints carry it)."""

_MAX_NAMES_LISTED = 20
"""An unknown-name error lists at most this many of the names stored."""


@dataclass(frozen=True, slots=True, eq=False)
class Variable:
    """One stored version of a named variable (its bytes are the store's: do not modify).

    Attributes:
        name: the variable's name.
        version: its version (1, 2, ...).
        layout: its tensors' specs, encoded (:func:`~replay_proto.variable_codec.encode_layout`).
        data: its tensors' bytes, concatenated in layout order (uint8).
        keys: how many tensors it holds.
        nbytes: what it is charged (see the module docstring).
    """

    name: str
    version: int
    layout: bytes
    data: np.ndarray
    keys: int
    nbytes: int

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """``{key: tensor}``, views of :attr:`data` built now (cost: one tensor per key)."""
        specs = decode_layout(self.layout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a view of a buffer nobody writes
            tensors, _ = decode_tensor_list(specs, memoryview(self.data))
        return {spec.key: tensor for spec, tensor in zip(specs, tensors)}


def check_name(name: Any) -> str:
    """``name`` if it is a valid variable name, else InvalidVariableError saying why."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 160 else (
            f"{name[:160]!r}... ({len(name)} characters)")
        raise InvalidVariableError(
            f"variable name {shown} is invalid: use 1-128 letters, digits, '_', '.', '-' or "
            f"'/', starting with a letter, digit or '_'")
    return name


def charged_bytes(layout: bytes, data_bytes: int) -> int:
    """Bytes a variable of encoded specs ``layout`` and ``data_bytes`` of tensors is charged."""
    return data_bytes + len(layout) + VARIABLE_OVERHEAD_BYTES


class VariableStore:
    """The server's named variables. See the module docstring.

    Args:
        max_bytes: budget for all variables together (see :func:`charged_bytes`).
    """

    def __init__(self, max_bytes: int) -> None:
        if not is_int(max_bytes) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._variables: dict[str, Variable] = {}
        self._versions: dict[str, int] = {}  # newest version per name
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held now, as counted against the budget."""
        return self._nbytes

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._variables)

    def version(self, name: str) -> int:
        """The newest version of ``name`` (0: never published). Lock-free: a hint for waiters."""
        return self._versions.get(name, 0)

    def publish(self, name: str, tensors: Mapping[str, torch.Tensor]) -> Variable:
        """Store a copy of ``tensors`` as the next version of ``name``; returns it.

        Raises:
            InvalidVariableError: a bad name, no tensors, a bad key or a tensor
                no table could store; nothing changed.
            VariableBudgetError: the budget would be exceeded; nothing changed.

        Cost: one copy of the tensors (outside the lock).
        """
        check_name(name)
        try:
            checked = check_state(tensors)
        except VariableFormatError as exc:
            raise InvalidVariableError(f"variable {name!r}: {exc}") from None
        specs, buffers = encode_tensors(
            {key: t.detach().to("cpu") for key, t in checked.items()})
        return self._store(name, encode_layout(specs), _joined(buffers), len(specs))

    def publish_packed(self, name: str, specs: Sequence[pb.TensorSpec],
                       payload: memoryview) -> Variable:
        """Store the next version of ``name`` from a Publish's specs and payload (one copy).

        The payload holds the tensors' bytes in spec order, as the wire carries them
        (:func:`~replay_proto.variable_codec.decode_publish_packed`).

        Raises:
            InvalidVariableError: see :meth:`publish`, or the payload does not match the specs.
            VariableBudgetError: see :meth:`publish`.
        """
        check_name(name)
        try:
            expected = sum(check_specs(specs))
        except VariableFormatError as exc:
            raise InvalidVariableError(f"variable {name!r}: {exc}") from None
        if expected != payload.nbytes:
            raise InvalidVariableError(
                f"variable {name!r}: the tensors described need {expected} bytes, the payload "
                f"has {payload.nbytes}")
        data = np.frombuffer(payload, dtype=np.uint8).copy()
        return self._store(name, encode_layout(specs), data, len(specs))

    def _store(self, name: str, layout: bytes, data: np.ndarray, keys: int) -> Variable:
        charged = charged_bytes(layout, data.nbytes)
        with self._lock:
            previous = self._variables.get(name)
            total = self._nbytes - (previous.nbytes if previous else 0) + charged
            if total > self.max_bytes:
                raise VariableBudgetError(
                    f"variable {name!r}: storing {charged:,} bytes ({keys:,} tensors) would "
                    f"bring the server's variables to {total:,} bytes, over "
                    f"server.variables_max_mb ({self.max_bytes:,} bytes); raise the budget or "
                    f"publish less")
            variable = Variable(name, self._versions.get(name, 0) + 1, layout, data, keys,
                                charged)
            self._variables[name] = variable
            self._versions[name] = variable.version
            self._nbytes = total
        return variable

    def get(self, name: str) -> Variable:
        """The newest version of ``name``.

        Raises:
            UnknownVariableError: nothing was ever published under ``name`` (the message
                lists at most 20 of the names stored).
        """
        with self._lock:
            variable = self._variables.get(name)
            if variable is None:
                names = sorted(self._variables)
                known = ", ".join(names[:_MAX_NAMES_LISTED]) or "none"
                if len(names) > _MAX_NAMES_LISTED:
                    known += f", ... ({len(names)} in all)"
                raise UnknownVariableError(
                    f"no variable named {name!r} has been published (variables: {known})")
            return variable

    def variables(self) -> list[Variable]:
        """Every variable's newest version (a snapshot of references)."""
        with self._lock:
            return list(self._variables.values())

    # ------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (no pickle): every variable's newest version.

        Cost: a tensor per key (views of the stored buffers); checkpoints use
        :meth:`variables` instead, which builds none.
        """
        return {
            "version": STATE_VERSION,
            "variables": [
                {"name": v.name, "version": v.version, "keys": list(tensors),
                 "tensors": list(tensors.values())}
                for v in self.variables() for tensors in (v.tensors,)
            ],
        }

    def load_state_dict(self, state: Any) -> None:
        """Replace every variable with those of a :meth:`state_dict`, all or nothing.

        Raises:
            MalformedStateError: the state is malformed, or holds a newer layout.
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, Mapping) else None
            raise MalformedStateError(
                f"variables: layout version {version!r}, this server reads {STATE_VERSION}")
        loaded: list[Variable] = []
        try:
            for entry in state["variables"]:
                keys, values = list(entry["keys"]), list(entry["tensors"])
                if len(keys) != len(values):
                    raise ValueError(f"variable {entry['name']!r} is malformed")
                checked = check_state(dict(zip(keys, values)))
                specs, buffers = encode_tensors(checked)
                layout = encode_layout(specs)
                loaded.append(self.restored(entry["name"], int(entry["version"]), layout,
                                            _joined(buffers)))
        except (KeyError, TypeError, ValueError, InvalidVariableError,
                VariableFormatError) as exc:
            raise MalformedStateError(f"variables: the saved state is malformed: {exc}") from None
        self.load(loaded)

    @staticmethod
    def restored(name: Any, version: int, layout: bytes, data: np.ndarray) -> Variable:
        """A variable read back from a checkpoint, checked like a publish.

        Raises:
            ValueError: the name, version, specs or bytes are malformed.
        """
        try:
            name = check_name(name)
            specs = decode_layout(layout)
            expected = sum(check_specs(specs))
        except (InvalidVariableError, VariableFormatError, CodecError) as exc:
            raise ValueError(str(exc)) from None
        if version < 1 or expected != data.nbytes or data.dtype != np.uint8:
            raise ValueError(f"variable {name!r} (version {version}) is malformed")
        return Variable(name, version, layout, data, len(specs),
                        charged_bytes(layout, data.nbytes))

    def load(self, variables: Sequence[Variable]) -> None:
        """Replace every variable with ``variables`` (restored ones: the budget is not applied).

        Raises:
            MalformedStateError: a name appears twice.
        """
        loaded = {v.name: v for v in variables}
        if len(loaded) != len(variables):
            raise MalformedStateError("variables: a name appears twice in the saved state")
        with self._lock:
            self._variables = loaded
            self._versions = {name: v.version for name, v in loaded.items()}
            self._nbytes = sum(v.nbytes for v in loaded.values())


def _joined(buffers: Sequence[memoryview]) -> np.ndarray:
    """The buffers' bytes, concatenated into one new uint8 array (one copy)."""
    data = np.empty(sum(b.nbytes for b in buffers), dtype=np.uint8)
    offset = 0
    for buffer in buffers:
        data[offset : offset + buffer.nbytes] = np.frombuffer(buffer, dtype=np.uint8)
        offset += buffer.nbytes
    return data
