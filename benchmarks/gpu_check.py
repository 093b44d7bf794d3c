"""`make gpu-check`: the GPU path in one prepared run, with one report.

    python benchmarks/gpu_check.py [--out DIR] [--short]      (or ``make gpu-check``)

A GPU machine is lent here rarely and briefly (about 15 minutes, start-up
included), so everything that needs one runs as this one command, already run
end to end on the CPU. Each step runs in its own process with its own time
limit, so a slow or hung step costs its limit and no more:

1. **environment**: machine, Python, torch and CUDA versions, the GPU, and every
   package the project imports that is missing (with the wheels to carry);
2. **server start**: a real server process, seconds from spawn to SERVING;
3. **tests**: ``tests/gpu`` (pinned memory, device delivery, device tables,
   starvation), one result per test; without CUDA, the simulated accelerator's
   tests (``tests/feed``) instead;
4. **delivery**: batches of 256 Atari rows to the device, in process, shared memory
   and gRPC (``benchmarks/learner.py``), and the in-process path's stages timed one by
   one (``benchmarks/delivery_stages.py``: draw, sample, gather on 1-8 threads, stream);
5. **starvation**: a 2 ms and a 10 ms GPU step fed by the stream against the same
   loop on data already there (``benchmarks/starvation.py``);
6. **device tables**: prioritized sample 256 + update on a device table, and
   TorchRL's ``LazyTensorStorage(device=...)`` + ``PrioritizedSampler`` beside it when
   a TorchRL built for this torch imports (``benchmarks/gpu_table.py``);
   and batches of a cuda table in a server process to this one through CUDA IPC,
   against host copies (``benchmarks/cuda_ipc.py``; skipped without CUDA);
7. **engine** and **service** headline rows on this machine's cores
   (``benchmarks/engine.py``, ``benchmarks/service.py``).

Without CUDA it runs the same steps on the CPU and says so on its first line:
its figures are then CPU figures, never GPU ones. ``--short`` runs every step
briefly (the suite runs it that way: tests/tools/test_gpu_check.py); ``--only`` runs
the steps it names.

Writes ``report.md`` and ``report.json`` (every figure, every test result, each
step's status, output tail and seconds) into ``--out`` (default ``gpu-check/``),
and exits 1 if any step failed or timed out or any test failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOURCES = [ROOT / part for part in ("proto", "feed", "client", "server")]
PACKAGES = {  # import name -> the distribution to carry as a wheel when it is missing
    "torch": "torch", "numpy": "numpy", "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking", "google.protobuf": "protobuf",
    "uvloop": "uvloop", "tensordict": "tensordict", "prometheus_client": "prometheus-client",
    "lz4": "lz4", "pytest": "pytest", "hypothesis": "hypothesis", "torchrl": "torchrl",
}
OPTIONAL = {"torchrl", "tensordict", "uvloop"}  # reported missing; the check goes on


@dataclass
class Step:
    """One step's outcome: ``status`` is ok, failed, timeout or skipped."""

    name: str
    status: str = "ok"
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    tests: list[dict[str, str]] = field(default_factory=list)
    note: str = ""
    tail: str = ""


class Check:
    """Runs the steps in order, each in a child process under its own limit."""

    def __init__(self, out: Path, short: bool, only: set[str] | None = None,
                 tests: list[str] | None = None) -> None:
        self.out = out
        self.tests = tests
        self.short = short
        self.only = only
        self.steps: list[Step] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            [str(p) for p in SOURCES] + [p for p in [os.environ.get("PYTHONPATH")] if p])}

    def run(self, name: str, argv: list[str], limit_s: float,
            read: Callable[[Step, str], None] | None = None, any_exit: bool = False) -> Step:
        """Run ``argv`` (a Python module or script) from the repository root; ``read``
        turns its output into figures. ``any_exit``: ``read`` judges the outcome (pytest's
        exit status 1 means a test failed, which its report names)."""
        step = Step(name)
        if not self.wanted(name):
            return step
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=self.env, text=True,
                                  capture_output=True, timeout=limit_s)
            output = done.stdout + done.stderr
            if done.returncode != 0 and not any_exit:
                step.status = "failed"
                step.note = f"exit {done.returncode}"
        except subprocess.TimeoutExpired as expired:
            output = _text(expired.stdout) + _text(expired.stderr)
            step.status, step.note = "timeout", f"over its {limit_s:g} s limit"
        step.seconds = round(time.monotonic() - started, 1)
        step.tail = output[-3000:]
        if read is not None and step.status == "ok":
            try:
                read(step, done.stdout)
            except (ValueError, KeyError, IndexError) as error:
                step.status, step.note = "failed", f"unreadable output: {error!r}"
        self.steps.append(step)
        print(f"{step.name}: {step.status} in {step.seconds:g} s {step.note}", flush=True)
        return step

    def wanted(self, name: str) -> bool:
        """Whether ``--only`` (if given) names the step (``device table, TorchRL``:
        ``device-table-torchrl``)."""
        return self.only is None or step_key(name) in self.only

    def skip(self, name: str, why: str) -> None:
        if not self.wanted(name):
            return
        self.steps.append(Step(name, status="skipped", note=why))
        print(f"{name}: skipped ({why})", flush=True)


def step_key(name: str) -> str:
    return "-".join(name.replace(",", " ").lower().split())


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def environment() -> dict[str, Any]:
    """Machine and versions, and which of the project's imports are missing."""
    facts: dict[str, Any] = {"python": platform.python_version(), "machine": platform.node(),
                             "cpus": os.cpu_count(), "missing": {}}
    sys.path[:0] = [str(p) for p in SOURCES]
    for module, distribution in PACKAGES.items():
        try:
            imported = importlib.import_module(module)
            facts.setdefault("versions", {})[distribution] = getattr(imported, "__version__", "")
        except Exception as error:  # noqa: BLE001 - any import failure is reported
            facts["missing"][distribution] = f"{type(error).__name__}: {error}"[:200]
    if "torchrl" not in facts["missing"]:
        try:  # its compiled sum tree must match this torch, or the prioritized sampler fails
            from torchrl.data import PrioritizedSampler

            PrioritizedSampler(8, 0.6, 0.4)
        except Exception as error:  # noqa: BLE001 - reported, and its step skipped
            facts["missing"]["torchrl"] = f"its prioritized sampler: {error}"[:200]
    try:
        import torch

        facts["cuda"] = torch.cuda.is_available()
        facts["torch_cuda"] = torch.version.cuda
        if facts["cuda"]:
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpu_memory_gib"] = round(
                torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    except ImportError:
        facts["cuda"] = False
    return facts


def _last_json(step: Step, stdout: str) -> None:
    step.figures.update(json.loads(stdout.strip().splitlines()[-1]))


def _read_json(path: Path) -> Callable[[Step, str], None]:
    def read(step: Step, _stdout: str) -> None:
        figures = json.loads(path.read_text())
        step.figures.update(figures if isinstance(figures, dict) else {"results": figures})
    return read


def _read_junit(path: Path) -> Callable[[Step, str], None]:
    def read(step: Step, _stdout: str) -> None:
        for case in ElementTree.parse(path).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "failed"}.get(child.tag, "skipped")
                    message = (child.get("message") or "")[:300]
            step.tests.append({"test": f"{case.get('classname')}::{case.get('name')}",
                               "outcome": outcome, "message": message})
        failed = [t for t in step.tests if t["outcome"] == "failed"]
        if failed or not step.tests:
            step.status = "failed"
            step.note = f"{len(failed)} test(s) failed" if failed else "no test ran"
    return read


def run_steps(check: Check, facts: dict[str, Any]) -> None:
    """Steps 2-7 (see the module docstring); limits sum to under 8 minutes."""
    cuda = facts["cuda"]
    device = ["--device", "cuda"] if cuda else []
    seconds = "0.5" if check.short else "4"
    prefill = ["--prefill", "2000"] if check.short else []
    work = check.out
    check.run("server start", [str(HERE / "gpu_check_start.py")], 60, _last_json)
    tests = check.tests or (["tests/gpu"] if cuda else
                            ["tests/feed/test_core.py", "tests/feed/test_resident.py"])
    junit = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "tests.xml"  # read into the report
    # Not the slow tests: tests/gpu's slowest runs this whole check again (make soak's).
    # -v: a step that runs out of time still names the test it was in.
    check.run("tests", ["-m", "pytest", "-v", "-m", "not slow", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", *tests], 150, _read_junit(junit), any_exit=True)
    for name, script, args, limit in [
            ("delivery", "learner.py", ["--seconds", seconds, *device, *prefill], 90),
            ("delivery stages", "delivery_stages.py",
             ["--seconds", "0.3" if check.short else "1"], 60),
            ("starvation", "starvation.py",
             [*device, "--batches", "20" if check.short else "150", *prefill], 90)]:
        path = work / f"{step_key(name)}.json"
        check.run(name, [str(HERE / script), *args, "--json", str(path)], limit,
                  _read_json(path))
    table = ["--device", "cuda" if cuda else "cpu", "--rows", "2000" if check.short else "20000",
             "--seconds", seconds]
    check.run("device table", [str(HERE / "gpu_table.py"), "--side", "ours", *table], 90,
              _last_json)
    if "torchrl" in facts["missing"]:
        check.skip("device table, TorchRL", f"torchrl does not import: "
                   f"{facts['missing']['torchrl']}")
    else:
        check.run("device table, TorchRL", [str(HERE / "gpu_table.py"), "--side", "torchrl",
                                            *table], 90, _last_json)
    if cuda:  # a cuda table in a server process to this one: CUDA IPC against host copies
        path = work / "cuda_ipc.json"
        check.run("device table through CUDA IPC",
                  [str(HERE / "cuda_ipc.py"), "--rows", "2000" if check.short else "20000",
                   "--seconds", "0.5" if check.short else "3", "--json", str(path)], 120,
                  _read_json(path))
    else:
        check.skip("device table through CUDA IPC", "no CUDA")
    rows = "20000" if check.short else "1000000"
    check.run("engine", [str(HERE / "engine.py"), "--side", "ours", "--case", "prioritized",
                         "--rows", rows, "--seconds", seconds], 60, _last_json)
    path = work / "service.json"
    check.run("service", [str(HERE / "service.py"), "--seconds", seconds, "--cases",
                          "sample", "--kinds", "atari", "--json", str(path)], 90,
              _read_json(path))


def report(check: Check, facts: dict[str, Any], headline: str) -> str:
    """The markdown report: the headline, the machine, then one section per step."""
    lines = [f"# {headline}", "", "| fact | value |", "|---|---|"]
    for key in ("gpu", "gpu_memory_gib", "torch_cuda", "python", "cpus", "machine"):
        if key in facts:
            lines.append(f"| {key} | {facts[key]} |")
    lines.append(f"| versions | {facts.get('versions', {})} |")
    if facts["missing"]:
        names = " ".join(f"{n}" for n in facts["missing"])
        lines += ["", f"Missing packages: {names} (benchmarks/gpu_wheels.sh fetches wheels to "
                  "carry; docs/learner.md, 'Checking a GPU machine')"]
    lines += ["", "| step | status | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:g} | {s.note} |" for s in check.steps]
    for step in check.steps:
        if step.figures:
            lines += ["", f"## {step.name}", "", "```json",
                      json.dumps(step.figures, indent=1, default=str)[:6000], "```"]
        failed = [t for t in step.tests if t["outcome"] != "passed"]
        if step.tests:
            lines += ["", f"## {step.name}: {len(step.tests)} tests, "
                      f"{sum(t['outcome'] == 'passed' for t in step.tests)} passed"]
            lines += [f"- {t['outcome']}: {t['test']} {t['message']}" for t in failed]
        if step.status in ("failed", "timeout"):
            lines += ["", f"## {step.name}: output's end", "", "```", step.tail, "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--short", action="store_true", help="every step briefly (the suite's)")
    parser.add_argument("--only", help="comma-separated steps to run (server-start, tests, "
                        "delivery, delivery-stages, starvation, device-table, "
                        "device-table-torchrl, device-table-through-cuda-ipc, engine, "
                        "service); default: all")
    parser.add_argument("--tests", nargs="*", help="test paths for the tests step (default: "
                        "tests/gpu with CUDA, the simulated accelerator's tests without)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    facts = environment()
    headline = (f"gpu-check on CUDA: {facts['gpu']}" if facts["cuda"] else
                "gpu-check WITHOUT CUDA: CPU and the simulated accelerator; no figure below "
                "is a GPU figure")
    print(headline, flush=True)
    check = Check(args.out, args.short, set(args.only.split(",")) if args.only else None,
                  args.tests)
    required = {n: why for n, why in facts["missing"].items() if n not in OPTIONAL}
    if required:
        check.skip("steps", f"missing packages: {', '.join(required)} (benchmarks/gpu_wheels.sh "
                   f"fetches them as wheels to carry; docs/learner.md)")
    else:
        with tempfile.TemporaryDirectory() as scratch:
            check.env["TMPDIR"] = scratch
            run_steps(check, facts)
    text = report(check, facts, headline)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps(
        {"headline": headline, "environment": facts,
         "steps": [vars(s) for s in check.steps]}, indent=1, default=str))
    bad = [s.name for s in check.steps if s.status in ("failed", "timeout")] + (
        ["missing packages"] if required else [])
    print(f"report: {args.out / 'report.md'}" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
