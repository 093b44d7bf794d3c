"""A package front's exports come from its one ``if TYPE_CHECKING:`` block (replay_proto.exports).

The block is parsed as the type checker reads it; a real package made in a temporary
directory shows the run-time side: names loaded on first use, ``__all__`` and ``dir()``,
and a name the block imports wrongly failing where it is used.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from replay_proto.exports import ExportError, declared_exports

FRONT = """
from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from {package}.rows import Row, make_row
    from {package}.rows import VERSION as ROWS_VERSION
    from {package}.rows import MISSING
else:
    __getattr__, __dir__ = lazy_exports(__name__)
"""


def test_each_imported_name_is_exported_from_its_module_or_under_its_alias():
    source = textwrap.dedent("""
        if TYPE_CHECKING:
            from a.b import X, Y as Z
            from a.c import W
    """)
    assert declared_exports(source) == {"X": "a.b", "Z": "a.b:Y", "W": "a.c"}


@pytest.mark.parametrize(("block", "said"), [
    ("    from .b import X", "absolute"),
    ("    import a.b", "absolute"),
    ("    X = 1", "absolute"),
    ("    from a.b import *", "'*' exports nothing by name"),
])
def test_anything_but_absolute_from_imports_in_the_block_is_refused_naming_the_line(block, said):
    with pytest.raises(ExportError, match=said) as raised:
        declared_exports(f"if TYPE_CHECKING:\n{block}\n", "front.py")
    assert "front.py:2" in str(raised.value)


def test_a_front_without_the_block_is_refused():
    with pytest.raises(ExportError, match="no 'if TYPE_CHECKING:' block"):
        declared_exports("X = 1\n", "front.py")


@pytest.fixture
def front(tmp_path):
    """A package ``lazyfront`` on sys.path whose front declares four names, one wrongly."""
    package = tmp_path / "lazyfront"
    package.mkdir()
    (package / "__init__.py").write_text(FRONT.format(package="lazyfront"))
    (package / "rows.py").write_text("VERSION = 3\nclass Row: ...\ndef make_row(): ...\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("lazyfront")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "lazyfront" or n.startswith("lazyfront.")]:
            del sys.modules[name]


def test_names_load_on_first_use_and_all_and_dir_list_them(front):
    assert "lazyfront.rows" not in sys.modules  # importing the front loads nothing
    assert front.__all__ == ["MISSING", "ROWS_VERSION", "Row", "make_row"]
    assert {"Row", "make_row", "ROWS_VERSION"} <= set(dir(front))
    assert "lazyfront.rows" not in sys.modules
    assert front.ROWS_VERSION == 3 and front.Row.__name__ == "Row"
    assert "lazyfront.rows" in sys.modules
    assert vars(front)["Row"] is front.Row  # kept in the package after the first use


def test_a_wrongly_declared_name_fails_where_it_is_used_and_an_undeclared_one_is_unknown(front):
    with pytest.raises(AttributeError, match="has no attribute 'MISSING'"):
        front.MISSING  # noqa: B018
    with pytest.raises(AttributeError, match="module 'lazyfront' has no attribute 'Other'"):
        front.Other  # noqa: B018
