"""The Makefile's set-up, run for real with a stand-in Python: quiet, and each step once.

Issue 24, friction 8: the first ``make serve`` showed about a minute of pip
output (and setuptools' licence banners); ``make demo`` reinstalled on every
run. The stand-in plays every Python the Makefile runs (the virtualenv's
too): it records its arguments and prints noise on stdout and stderr, so
whatever reaches make's output unfiltered shows up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
for i in 1 2 3; do echo "noise $i"; echo "warning noise $i" >&2; done
if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then echo "the cause"; exit 3; fi
"""


@pytest.fixture
def project(tmp_path: Path):
    """A copy of what the set-up reads, and ``make(target)`` with the stand-in Python."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "proto" / "replay" / "v1").mkdir(parents=True)
    shutil.copy(ROOT / "proto" / "replay" / "v1" / "replay.proto",
                tmp_path / "proto" / "replay" / "v1")
    python = tmp_path / "python-stand-in"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    calls = tmp_path / "calls"

    def make(target: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        calls.write_text("")
        result = subprocess.run(["make", "--no-print-directory", target, f"PYTHON={python}"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "CALLS": str(calls), **env}, check=False)
        return result, calls.read_text().splitlines()

    return make


def test_install_prints_one_line_per_step_and_none_of_their_output(project):
    result, calls = project("install")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "noise" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("setting up .venv") and len(lines) == 5, lines
    assert any(" -e .[test]" in call for call in calls)
    again, calls = project("install")
    assert again.returncode == 0 and calls == []  # installed once


def test_a_failed_step_shows_its_output_and_the_log(project):
    result, _ = project("install", FAIL_ON="-e .[test]")
    assert result.returncode != 0
    assert "the cause" in result.stdout
    assert "set-up step failed: replay-server and its test tools" in result.stdout
    assert ".venv/setup.log" in result.stdout


def test_demo_installs_its_packages_once(project):
    first, calls = project("demo")
    assert first.returncode == 0, first.stdout + first.stderr
    assert any(" -e .[examples]" in call for call in calls)
    second, calls = project("demo")
    assert second.returncode == 0
    assert calls == ["-m examples.dqn_cartpole"]


def test_the_licence_is_an_spdx_string():
    # A {text = ...} table made setuptools print a deprecation banner, four times per install.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
