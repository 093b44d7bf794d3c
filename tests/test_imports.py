"""Every ``from replay_* import name`` in the repository resolves, the function-local ones too.

The CLI's light commands import lazily (inside functions) so that ``--version`` and
``health`` load no torch; such an import is only run by the command that needs it,
so a module split that moves a name breaks it silently until a user runs that
command. This reads every import statement and resolves it now.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("replay_server", "replay_client", "replay_feed", "replay_proto")
SOURCES = [p for folder in ("server", "client", "feed", "proto", "benchmarks", "examples",
                            "deploy", "tests")
           for p in sorted((ROOT / folder).rglob("*.py")) if "_pb2" not in p.name]


def _imports() -> list:
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in OURS):
                names = tuple(a.name for a in node.names if a.name != "*")
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found.append(pytest.param(node.module, names, id=where))
    return found


@pytest.mark.parametrize(("module", "names"), _imports())
def test_import_resolves(module: str, names: tuple[str, ...]) -> None:
    loaded = importlib.import_module(module)
    for name in names:
        if not hasattr(loaded, name):
            importlib.import_module(f"{module}.{name}")  # a submodule: raises if missing
