"""Every Python and TOML example in README.md and docs/*.md works as written.

Python blocks run in order, each in a fresh namespace, against one real server
with the default tables and a checkpoint directory (``localhost:50051`` in the
text is rewritten to its address); TOML blocks must load as server configs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from replay_server.app.config_file import settings_from_dict

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(language: str) -> list:
    pattern = re.compile(rf"```{language}\n(.*?)```", re.DOTALL)
    return [
        pytest.param(code, id=f"{path.name}:{n}")
        for path in DOCS
        for n, code in enumerate(pattern.findall(path.read_text()), start=1)
    ]


PYTHON = _blocks("python")
TOML = _blocks("toml")


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    from tests.conftest import start_server

    tmp = tmp_path_factory.mktemp("docs")
    proc = start_server(tmp, f'[server]\ncheckpoint_dir = "{tmp / "checkpoints"}"\n'
                             f'checkpoint_interval_s = 0\n')
    yield proc.address
    proc.stop()


def test_readme_has_client_examples():
    assert any("README" in p.id and "ReplayClient" in p.values[0] for p in PYTHON)


@pytest.mark.parametrize("code", PYTHON)
def test_python_example_runs(code, address):
    code = code.replace("localhost:50051", address)
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})


@pytest.mark.parametrize("code", TOML)
def test_toml_example_is_a_valid_config(code):
    import tomllib

    settings_from_dict(tomllib.loads(code))
