"""Named variables: versioned state dicts (tensors only) that a learner publishes to its actors.

A variable is a name, a version and a flat mapping of string keys (a state
dict's keys, dots included, taken as they are) to CPU tensors. Each publish
of a name stores a private copy as the next version (1, 2, ...) and drops
the previous one: only the newest is kept. Versions never go back, not even
across a checkpoint and restore (the store is part of checkpoints).

Bounded: all variables together hold at most ``max_bytes`` of tensor data
(plus a small per-key allowance); a publish past that is refused whole with
:class:`~replay_server.errors.VariableBudgetError`, and what was stored
before stays. Bad input (an empty or malformed name, no tensors, an empty
key, a dtype no table could store) is refused with
:class:`~replay_server.errors.InvalidVariableError` naming what was wrong.

This is how a policy that cannot be pickled or deep-copied reaches its
actors: only its tensors travel (no pickle, the tensor codec's raw bytes).

Thread-safety: every method may be called from any thread; one lock guards
the mapping, held only to swap or read references (copies happen outside it).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from replay_proto.variable_codec import VariableFormatError, check_state
from replay_server.errors import (
    InvalidVariableError,
    MalformedStateError,
    UnknownVariableError,
    VariableBudgetError,
)

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,127}")
"""Variable names: 1-128 letters, digits, ``_``, ``.``, ``-`` or ``/``, not starting with
``.``, ``-`` or ``/``."""

KEY_OVERHEAD_BYTES = 64
"""What each key is counted for beyond its tensor's bytes (keeps the count of keys bounded too)."""

STATE_VERSION = 1
"""Layout version of :meth:`VariableStore.state_dict` (checkpoints carry it)."""


@dataclass(frozen=True, slots=True)
class Variable:
    """One stored version of a named variable (its tensors are the store's: do not modify)."""

    name: str
    version: int
    tensors: dict[str, torch.Tensor]
    nbytes: int


def check_name(name: Any) -> str:
    """``name`` if it is a valid variable name, else InvalidVariableError saying why."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidVariableError(
            f"variable name {name!r} is invalid: use 1-128 letters, digits, '_', '.', '-' or "
            f"'/', starting with a letter, digit or '_'")
    return name


def charged_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes a variable of ``tensors`` counts against the budget."""
    return sum(t.numel() * t.element_size() + KEY_OVERHEAD_BYTES + len(k)
               for k, t in tensors.items())


class VariableStore:
    """The server's named variables. See the module docstring.

    Args:
        max_bytes: budget for all variables together (see :func:`charged_bytes`).
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
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
            InvalidVariableError: a bad name, no tensors, an empty key or a
                tensor no table could store; nothing changed.
            VariableBudgetError: the budget would be exceeded; nothing changed.

        Cost: one copy of the tensors (outside the lock).
        """
        check_name(name)
        copies = _checked_copies(name, tensors)
        charged = charged_bytes(copies)
        with self._lock:
            previous = self._variables.get(name)
            total = self._nbytes - (previous.nbytes if previous else 0) + charged
            if total > self.max_bytes:
                raise VariableBudgetError(
                    f"variable {name!r}: storing {charged:,} bytes would bring the server's "
                    f"variables to {total:,} bytes, over server.variables_max_mb "
                    f"({self.max_bytes:,} bytes); raise the budget or publish less")
            variable = Variable(name, self._versions.get(name, 0) + 1, copies, charged)
            self._variables[name] = variable
            self._versions[name] = variable.version
            self._nbytes = total
        return variable

    def get(self, name: str) -> Variable:
        """The newest version of ``name``.

        Raises:
            UnknownVariableError: nothing was ever published under ``name``.
        """
        with self._lock:
            variable = self._variables.get(name)
            if variable is None:
                known = ", ".join(sorted(self._variables)) or "none"
                raise UnknownVariableError(
                    f"no variable named {name!r} has been published (variables: {known})")
            return variable

    # ------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (no pickle): every variable's newest version."""
        with self._lock:
            variables = list(self._variables.values())
        return {
            "version": STATE_VERSION,
            "variables": [
                {"name": v.name, "version": v.version, "keys": list(v.tensors),
                 "tensors": list(v.tensors.values())}
                for v in variables
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
        loaded: dict[str, Variable] = {}
        try:
            for entry in state["variables"]:
                name, version = check_name(entry["name"]), int(entry["version"])
                keys, values = list(entry["keys"]), list(entry["tensors"])
                if len(keys) != len(values) or version < 1 or name in loaded:
                    raise ValueError(f"variable {name!r} is malformed")
                tensors = _checked_copies(name, dict(zip(keys, values)))
                loaded[name] = Variable(name, version, tensors, charged_bytes(tensors))
        except (KeyError, TypeError, ValueError, InvalidVariableError) as exc:
            raise MalformedStateError(f"variables: the saved state is malformed: {exc}") from None
        with self._lock:
            self._variables = loaded
            self._versions = {name: v.version for name, v in loaded.items()}
            self._nbytes = sum(v.nbytes for v in loaded.values())


def _checked_copies(name: str, tensors: Any) -> dict[str, torch.Tensor]:
    """Private contiguous CPU copies of ``tensors``, or InvalidVariableError naming the key."""
    try:
        checked = check_state(tensors)
    except VariableFormatError as exc:
        raise InvalidVariableError(f"variable {name!r}: {exc}") from None
    return {key: t.detach().to("cpu", copy=True).contiguous() for key, t in checked.items()}
