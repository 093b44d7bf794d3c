"""Every Python example in README.md and docs/*.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)

EXAMPLES = [
    pytest.param(code, id=f"{path.name}:{n}")
    for path in DOCS
    for n, code in enumerate(BLOCK.findall(path.read_text()), start=1)
]


def test_readme_has_examples():
    assert any("README" in p.id for p in EXAMPLES)


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code):
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
