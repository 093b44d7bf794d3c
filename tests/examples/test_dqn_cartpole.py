"""A short bounded run of examples/dqn_cartpole: server, two actors and the learner really run.

Rows are inserted through the actors' Writers, the learner updates priorities from its stream
and publishes weights, every actor fetches them, the plot is written, and nothing fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_bounded_run_inserts_learns_publishes_and_reports_no_errors(tmp_path) -> None:
    summary_path, plot = tmp_path / "summary.json", tmp_path / "plot.png"
    result = subprocess.run(
        [sys.executable, "-m", "examples.dqn_cartpole", "--actors", "2", "--max-env-steps", "400",
         "--min-size", "64", "--batch-size", "32", "--eval-every-s", "1000",
         "--summary", str(summary_path), "--plot", str(plot)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["errors"] == []
    assert summary["env_steps"] >= 400 and summary["inserted"] >= 400
    assert summary["updates"] > 0 and summary["priority_updates"] >= summary["updates"] * 32
    assert summary["published_version"] >= 1
    assert set(summary["actors"]) == {"0", "1"}
    for actor in summary["actors"].values():  # each loaded the learner's weights, no errors
        assert actor["versions_loaded"] and actor["versions_loaded"][0] >= 1
        assert actor["error"] == ""
    assert summary["evaluations"], "the final greedy evaluation did not run"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "env steps" in result.stdout
