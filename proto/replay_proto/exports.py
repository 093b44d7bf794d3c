"""A package's exported names, imported from their modules on first use (PEP 562).

The packages whose ``__init__`` re-exports names (``replay_proto``,
``replay_server`` and its ``engine``, ``checkpoint``, ``service`` and ``app``)
would otherwise import torch and the engine with the package itself, which the
``replay-server`` command's light commands (``health``, ``check-config``,
``--version``) must not pay for.

**One declaration.** A front names each export once, as an import in its
``if TYPE_CHECKING:`` block, which is what the type checker reads; the
``else`` branch, which the type checker never sees (so a name the block does
not import is an error there, not ``Any``), loads them at run time::

    # ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports
    if TYPE_CHECKING:
        from replay_proto.batch import EXTRAS, SampleBatch
    else:
        __getattr__, __dir__ = lazy_exports(__name__)

:func:`lazy_exports` reads that same block from the package's source (on the
first name asked for, never at import): each imported name is exported, found
in the module it is imported from (``as`` exports it under another name), and
``__all__`` lists them all. A name the block imports wrongly fails the type
checker and the test that resolves every export
(``tests/server/app/test_cli_imports.py``). The block may hold only
``from MODULE import NAME[ as OTHER]`` statements (absolute).

Cost: one parse of the ``__init__`` source (well under a millisecond) on the
first name a program asks for; each name's module is imported on its own first
use. Thread-safety: as imports are (two threads may parse once each; the result
is the same).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from typing import Any


class ExportError(ImportError):
    """A package front's ``if TYPE_CHECKING:`` block holds something other than absolute
    ``from ... import ...`` statements, or no such block."""


def declared_exports(source: str, filename: str = "<front>") -> dict[str, str]:
    """The names imported under ``if TYPE_CHECKING:`` in ``source``: export name -> its home,
    ``"module"`` or ``"module:attribute"`` (exported under another name).

    Raises:
        ExportError: the block holds anything else, or there is no such block.
    """
    import ast  # here, not at the top: only a front's first name asked for pays for it

    homes: dict[str, str] = {}
    blocks = [node for node in ast.parse(source, filename).body if isinstance(node, ast.If)
              and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    if not blocks:
        raise ExportError(f"{filename}: no 'if TYPE_CHECKING:' block naming the exports")
    for node in (statement for block in blocks for statement in block.body):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
            raise ExportError(f"{filename}:{node.lineno}: an export is declared as "
                              f"'from package.module import name' (absolute), nothing else")
        for alias in node.names:
            if alias.name == "*":
                raise ExportError(f"{filename}:{node.lineno}: '*' exports nothing by name")
            name = alias.asname or alias.name
            homes[name] = node.module if alias.asname is None else f"{node.module}:{alias.name}"
    return homes


def lazy_exports(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package`` (called from its ``__init__``):
    the names its ``if TYPE_CHECKING:`` block imports, each imported from its module when
    first asked for and then kept in the package; ``__all__`` is all of them."""
    path = sys.modules[package].__file__
    found: list[dict[str, str]] = []

    def homes() -> dict[str, str]:
        if not found:
            assert path is not None  # a package front is a source file
            with open(path, encoding="utf-8") as file:
                found.append(declared_exports(file.read(), path))
        return found[0]

    def __getattr__(name: str) -> Any:
        if name == "__all__":
            value: Any = sorted(homes())
        else:
            home = homes().get(name)
            if home is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            module, _, attribute = home.partition(":")
            value = getattr(import_module(module), attribute or name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes()))

    return __getattr__, __dir__
