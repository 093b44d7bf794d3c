"""`make gpu-check` (benchmarks/gpu_check.py) runs here too, on the CPU.

A GPU machine is lent rarely and briefly, so the check must already work end to end
before it gets one: here it runs its steps against the CPU and the simulated
accelerator, says so first, writes its report, and exits 1 when a test it ran failed.
The bounded version runs the quick steps; the slow one (``make soak``) every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.py"


def _check(out: Path, *args: str, timeout: float = 600) -> tuple[int, str, dict]:
    done = subprocess.run([sys.executable, str(CHECK), "--short", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    report = json.loads((out / "report.json").read_text())
    return done.returncode, done.stdout + done.stderr, report


def _steps(report: dict) -> dict[str, dict]:
    return {step["name"]: step for step in report["steps"]}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[Path, int, str, dict]:
    """One bounded run: the quick steps, and the tests step on a planted file of one
    passing and one failing test."""
    out = tmp_path_factory.mktemp("gpu-check")
    planted = out / "test_planted.py"
    planted.write_text("def test_holds():\n    assert True\n\n"
                       "def test_breaks():\n    assert 1 == 2, 'planted'\n")
    code, output, report = _check(out / "report", "--only", "server-start,tests,device-table,"
                                  "device-table-torchrl,device-table-through-cuda-ipc",
                                  "--tests", str(planted))
    return out / "report", code, output, report


def test_it_says_what_it_ran_on_and_reports_figures(checked) -> None:
    out, _, _, report = checked
    first = (out / "report.md").read_text().splitlines()[0]
    if torch.cuda.is_available():
        assert first.startswith("# gpu-check on CUDA: ")
    else:
        assert first == ("# gpu-check WITHOUT CUDA: CPU and the simulated accelerator; no "
                         "figure below is a GPU figure")
    steps = _steps(report)
    start = steps["server start"]
    assert start["status"] == "ok" and start["figures"]["health"] == "SERVING"
    assert 0 < start["figures"]["serving_s"] < 45
    table = steps["device table"]
    assert table["status"] == "ok" and table["figures"]["batches_per_s"] > 0
    torchrl = steps["device table, TorchRL"]
    assert torchrl["status"] == "ok" or (torchrl["status"] == "skipped" and torchrl["note"])
    ipc = steps["device table through CUDA IPC"]
    if torch.cuda.is_available():  # CUDA IPC, or host copies where the sandbox refused it
        assert ipc["status"] == "ok", ipc
        assert ipc["figures"]["cuda_ipc"]["batches_per_s"] > 0
        assert ipc["figures"]["cuda_ipc"]["transport"] in ("cuda_ipc", "grpc")
    else:
        assert ipc["status"] == "skipped" and ipc["note"] == "no CUDA"
    assert set(steps) == {"server start", "tests", "device table", "device table, TorchRL",
                          "device table through CUDA IPC"}  # --only ran only those


def test_a_failing_test_fails_the_check_and_is_named(checked) -> None:
    out, code, output, report = checked
    assert code == 1, output
    step = _steps(report)["tests"]
    assert step["status"] == "failed" and step["note"] == "1 test(s) failed"
    outcomes = {t["test"].rsplit("::", 1)[1]: t["outcome"] for t in step["tests"]}
    assert outcomes == {"test_holds": "passed", "test_breaks": "failed"}
    assert output.rstrip().endswith("failed: tests")
    assert "- failed: " in (out / "report.md").read_text()


@pytest.mark.slow
def test_every_step_runs_end_to_end(tmp_path: Path) -> None:
    code, output, report = _check(tmp_path, timeout=1200)
    assert code == 0, output
    steps = _steps(report)
    for name in ("server start", "tests", "delivery", "starvation", "device table", "engine",
                 "service"):
        assert steps[name]["status"] == "ok", (name, steps[name])
    assert steps["delivery"]["figures"]["ours"]["shared memory"]["batches_per_s"] > 0
