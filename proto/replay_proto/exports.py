"""A package's exported names, imported from their modules on first use (PEP 562).

The three packages whose ``__init__`` re-exports names (``replay_proto``,
``replay_server``, ``replay_server.app``) would otherwise import torch and
the engine with the package itself, which the ``replay-server`` command's
light commands (``health``, ``--version``) must not pay for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name in ``homes`` (name ->
    the module defining it, or ``"module:attribute"`` for a name exported under another)
    when it is first asked for, and keeps it in the package."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = home.partition(":")
        value = getattr(import_module(module), attribute or name)
        setattr(import_module(package), name, value)
        return value

    return __getattr__
