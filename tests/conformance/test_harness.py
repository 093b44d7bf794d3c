"""The conformance harness, run on its own TorchRL-style sample files (tests/conformance/samples)
with this venv's torchrl: verdicts, reasons and totals come out as the report says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conformance import scope

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "conformance" / "samples"


def test_the_harness_reports_a_verdict_and_reason_per_test(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.conformance", "--tests", str(SAMPLES), "--out",
         str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()

    def line(name: str) -> str:
        found = [text for text in lines if f"::{name}" in text]
        assert found, f"no verdict for {name}:\n{result.stdout}"
        return found[0]

    assert line("test_extend_sample[8]").startswith("PASS")
    assert line("test_extend_sample[16]").startswith("PASS")
    cursor = line("test_cursor_internals")
    assert cursor.startswith("N/A") and "_writer" in cursor  # it reads TorchRL's private state
    assert line("test_index_is_a_position").startswith("PASS")  # issue 32: positions
    keys = line("test_a_write_without_some_keys")
    assert keys.startswith("FAIL") and "SchemaMismatchError" in keys  # the reason: the error
    assert line("test_plain_tensors").startswith("PASS") and "(other data)" in line(
        "test_plain_tensors")
    assert not [text for text in lines if "test_without_replacement" in text]  # out of scope
    out_of_scope = result.stdout.split("Out of scope (not counted):")[1]
    assert "1  uses SamplerWithoutReplacement" in out_of_scope
    assert "1  builds no replay buffer" in out_of_scope
    assert "1  skipped with TorchRL's own buffers" in out_of_scope
    assert ("TensorDict data (the headline): 5 tests: 3 pass, 1 fail, 1 not applicable; "
            "75.0% of the applicable ones pass") in result.stdout
    assert (tmp_path / "report.txt").read_text().strip() == result.stdout.strip()


def test_not_applicable_entries_name_their_reason() -> None:
    for pattern, reason in scope.NOT_APPLICABLE:
        assert reason and pattern
    assert scope.reason_not_applicable("t.py::test_x", ["ReplayBuffer._storage"]) == (
        "reads TorchRL's private state: ReplayBuffer._storage")
    assert scope.reason_out_of_scope(["storage=LazyTensorStorage", "storage.ndim=2"]).startswith(
        "uses storage.ndim=2")
    assert scope.reason_out_of_scope(["sampler=PrioritizedSampler"]) == ""


def test_a_run_into_an_earlier_runs_out_directory_starts_its_own_servers(tmp_path) -> None:
    """A second run into the same --out took the first run's port files for its servers' and
    connected to ports no server listened on: every remote test failed, unavailable."""
    from replay_client import ReplayClient
    from tests.conformance.servers import ServerPool

    (tmp_path / "server0.port").write_text("1")  # what the earlier run left behind
    pool = ServerPool(sys.executable, tmp_path)
    try:
        address, table = pool.table({"capacity": 10, "sampler": "uniform"})
        assert table in ReplayClient(address, timeout=10).info()
    finally:
        pool.close()
