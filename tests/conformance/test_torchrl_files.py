"""The conformance harness on a handful of TorchRL's own test files, where a copy is at hand.

CI has no copy of pytorch/rl's ``test/rb`` (it is not ours to commit) nor the
TorchRL virtualenv, so this test runs only when ``make conformance`` has been
set up here: ``TORCHRL_TESTS`` names the copy of ``test/rb`` (0.14 line),
``TORCHRL_VENV`` the TorchRL virtualenv (default ``.venv-torchrl``) and
``CONFORMANCE_SITE`` where pytest and grpcio were installed for it (default
``.venv-conformance-site``). Otherwise it skips, saying which is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PASSING = [
    "test_query.py::TestReplayBufferQuery::test_query_all",
    "test_query.py::TestReplayBufferQuery::test_query_after_wraparound",
    "test_rb_core.py::test_replay_buffer_read_write_all_in_order_with_end",
]
"""TorchRL tests that pass swapped: the harness must run them and report PASS."""

PRIVATE = "test_query.py::TestReplayBufferQuery::test_query_matches_slice_sampler_boundaries"
"""A TorchRL test that reads a sampler's private method: not applicable, with that reason."""


def _setup() -> tuple[Path, Path, Path]:
    tests = os.environ.get("TORCHRL_TESTS", "")
    venv = Path(os.environ.get("TORCHRL_VENV", ROOT / ".venv-torchrl"))
    site = Path(os.environ.get("CONFORMANCE_SITE", ROOT / ".venv-conformance-site"))
    missing = []
    if not tests or not (Path(tests) / "test_rb_core.py").exists():
        missing.append("TORCHRL_TESTS=<a copy of pytorch/rl's test/rb, 0.14 line>")
    if not (venv / "bin" / "python").exists():
        missing.append(f"TORCHRL_VENV (no interpreter at {venv}/bin/python)")
    if not (site / "pytest").is_dir() or not (site / "grpc").is_dir():
        missing.append(f"CONFORMANCE_SITE (no pytest and grpc at {site}: `make conformance` installs them)")
    if missing:
        pytest.skip("TorchRL's own tests are not set up here: " + "; ".join(missing))
    return Path(tests), venv / "bin" / "python", site


def test_the_harness_runs_torchrl_tests_swapped(tmp_path) -> None:
    tests, python, site = _setup()
    nodes = [*PASSING, PRIVATE]
    result = subprocess.run(
        [sys.executable, "-m", "tests.conformance", "--tests", str(tests), "--python",
         str(python), "--site", str(site), "--out", str(tmp_path),
         *(str(tests / node) for node in nodes)],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = {line.split()[1]: line for line in result.stdout.splitlines()
                if line.startswith(("PASS", "FAIL", "N/A"))}
    for node in PASSING:
        assert verdicts.get(node, "").startswith("PASS"), result.stdout
    assert verdicts[PRIVATE].startswith("N/A") and "_get_stop_and_length" in verdicts[PRIVATE]
    assert ("TensorDict data (the headline): 4 tests: 3 pass, 0 fail, 1 not applicable"
            in result.stdout)
