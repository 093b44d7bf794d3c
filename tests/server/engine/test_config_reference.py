"""The ``[[tables]]`` reference in docs/service.md is the specs' own: every key, its default,
the layers that own it and its doc line, as the table config and each layer's spec declare
them (``engine.config.table_options``). A key added to a spec without the docs, a key
documented that no spec has, or a default changed on one side only fails here; the
expected table is printed to paste.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_server.engine.config import TableConfig, table_options

DOC = Path(__file__).resolve().parents[3] / "docs" / "service.md"
HEADER = "| key | default | for | meaning |"


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def reference() -> list[str]:
    """The reference table's lines, from the specs."""
    lines = [HEADER, "|---|---|---|---|"]
    for key, owners in table_options().items():
        doc = owners[0][1]
        default = "required" if doc.required else _toml(doc.default)
        meaning = doc.doc + (" (other samplers take it too, without effect)" if doc.inert else "")
        lines.append(f"| `{key}` | {default} | {', '.join(o for o, _ in owners)} | {meaning} |")
    return lines


def documented() -> list[str]:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER)
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_the_docs_reference_is_the_specs() -> None:
    expected = reference()
    assert documented() == expected, "docs/service.md's [[tables]] reference should read:\n" \
        + "\n".join(expected)


def test_every_default_documented_is_the_one_a_table_gets() -> None:
    made = TableConfig(name="t", capacity=10)
    for key, owners in table_options().items():
        doc = owners[0][1]
        if key in ("name", "capacity", "schema") or doc.required:
            continue
        assert {repr(d.default) for _, d in owners} == {repr(doc.default)}, key  # one default
        assert getattr(made, key) == doc.default, key
