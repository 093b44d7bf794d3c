"""Starvation benchmark: does a learner with a fixed step ever wait for its data?

    python benchmarks/starvation.py [--device cuda] [--steps-ms 2,10] [--batches 150]

(or ``make bench-starvation``). A learner loop takes a batch and runs a step
of fixed length on it, fed by each path: ``in process`` (an embedded
server's table), ``shared memory`` and ``grpc`` (a server in its own
process, on loopback). The same loop over data already in place (a few
batches, prepared before the clock starts, cycled) is the reference. Atari
rows (28 KB), batch 256, prefetch 2, a prioritized table of 20,000 rows.

Reported per path and step: ``ratio`` = the reference loop's time / the fed
loop's time (1.0: the feed costs the learner nothing; the target on a GPU is
>= 0.95), and the *idle fraction*: the share of the fed loop's time the
step's executor had nothing to do.

* ``--device cuda``: the step is a calibrated GPU kernel (``torch.cuda._sleep``
  spinning the SMs for 2 ms and 10 ms), batches are delivered to the GPU, and
  the idle fraction is the GPU's, measured with CUDA events around every step
  (gaps between the end of one step and the start of the next, over the span
  of the loop).
* without ``--device`` (any machine): the step is host time (``--cpu-step
  sleep``: the thread sleeps, like a host waiting on a GPU kernel; ``spin``:
  it busy-loops, holding a core like CPU compute), batches stay on the host,
  and the idle fraction is the share of the loop spent waiting in ``next()``.
  These are CPU figures, not GPU ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402
from sides import replay_server  # noqa: E402

KIND = "atari"
PREFILL = 20_000
PREFETCH = 2
WARMUP = 5

_CONFIG = (
    "[server]\nmax_message_mb = 64\nworkers = 2\n"
    f'[[tables]]\nname = "{KIND}"\ncapacity = {w.CAPACITY[KIND]}\n'
    f'sampler = "prioritized"\nalpha = {w.ALPHA}\nbeta = {w.BETA}\n'
)


@dataclass
class LoopResult:
    """One learner loop: wall seconds for its steps and the share of them its executor idled."""

    seconds: float
    idle_fraction: float
    steps: int


class CpuStep:
    """A fixed host step: sleep (a host waiting on a device kernel) or spin (CPU compute)."""

    def __init__(self, ms: float, mode: str = "sleep") -> None:
        if mode not in ("sleep", "spin"):
            raise ValueError(f"cpu step mode must be 'sleep' or 'spin', got {mode!r}")
        self.seconds = ms / 1e3
        self.mode = mode

    def __call__(self, batch: Any) -> None:
        if self.mode == "sleep":
            time.sleep(self.seconds)
            return
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass

    def run(self, batches: Any, steps: int) -> LoopResult:
        """Run ``steps`` steps over ``batches``; idle = time spent waiting for the next batch."""
        iterator = iter(batches)
        for _ in range(WARMUP):
            self(next(iterator))
        waited = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            before = time.perf_counter()
            batch = next(iterator)
            waited += time.perf_counter() - before
            self(batch)
        elapsed = time.perf_counter() - start
        return LoopResult(elapsed, waited / elapsed, steps)


class CudaStep:
    """A fixed GPU step: ``torch.cuda._sleep`` calibrated to ``ms`` of kernel time.

    The step reads one byte of every tensor of the batch first, so the kernel
    depends on the batch's copy (the stream waits for it). Idle time is read
    from CUDA events recorded around every step.
    """

    def __init__(self, ms: float) -> None:
        import torch

        self.torch = torch
        self.cycles = int(ms * _cycles_per_ms())
        self.ms = ms

    def __call__(self, batch: Any) -> list[Any]:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for tensor in _tensors(batch):
            tensor.reshape(-1)[:1].sum()
        torch.cuda._sleep(self.cycles)
        end.record()
        return [start, end]

    def run(self, batches: Any, steps: int) -> LoopResult:
        """Run ``steps`` steps; idle = GPU time between steps over the loop's GPU span."""
        torch = self.torch
        iterator = iter(batches)
        for _ in range(WARMUP):
            self(next(iterator))
        torch.cuda.synchronize()
        marks = []
        start = time.perf_counter()
        for _ in range(steps):
            marks.append(self(next(iterator)))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        span = marks[0][0].elapsed_time(marks[-1][1])
        busy = sum(s.elapsed_time(e) for s, e in marks)
        return LoopResult(elapsed, max(0.0, 1 - busy / span), steps)


def _cycles_per_ms() -> float:
    import torch

    torch.cuda._sleep(1_000_000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _tensors(batch: Any) -> list[Any]:
    from replay_feed import tree_leaves

    return tree_leaves(batch)[0]


def _fill(insert: Any) -> None:
    import torch

    for first in range(0, PREFILL, 1_000):
        rows = w.make_rows(KIND, first, 1_000)
        insert({key: torch.from_numpy(value) for key, value in rows.items()})


def _preloaded(stream: Any, count: int, device: str | None) -> list[Any]:
    """``count`` batches taken from ``stream`` and kept (cloned off the stream's ring)."""
    import torch

    kept = []
    with stream:
        for _ in range(count):
            batch = next(stream)
            kept.append(batch.with_tensors([t.clone() for t in batch.tensors()]))
    if device is not None:
        torch.cuda.synchronize()
    return kept


def _compare(step: Any, open_stream: Any, batches: int, device: str | None) -> dict:
    """The step's loop fed by a fresh stream, then over preloaded batches; ratio and idle."""
    reference = step.run(itertools.cycle(_preloaded(open_stream(), 4, device)), batches)
    stream = open_stream()
    with stream:
        fed = step.run(stream, batches)
        transport = stream.transport
    return {"transport": transport, "fed": asdict(fed), "preloaded": asdict(reference),
            "ratio": reference.seconds / fed.seconds}


def ours(steps_ms: list[float], batches: int, device: str | None, cpu_step: str) -> dict:
    import torch

    from replay_client import ReplayClient
    from replay_server.app.config_file import settings_from_dict
    from replay_server.app.embedded import EmbeddedServer

    torch.set_num_threads(1)
    steps = {ms: (CudaStep(ms) if device else CpuStep(ms, cpu_step)) for ms in steps_ms}
    results: dict[str, dict] = {}

    def measure(path: str, open_stream: Any) -> None:
        for ms, step in steps.items():
            result = _compare(step, open_stream, batches, device)
            results[f"{path}, {ms:g} ms step"] = result
            print(f"  {path}, {ms:g} ms: ratio {result['ratio']:.3f}, idle "
                  f"{result['fed']['idle_fraction']:.1%}", file=sys.stderr)

    settings = settings_from_dict(tomllib.loads(_CONFIG))
    with EmbeddedServer(settings, listen=False) as server:
        _fill(server.tables[KIND].insert)
        measure("in process", lambda: server.stream(KIND, w.SAMPLE_BATCH, prefetch=PREFETCH,
                                                    device=device))
    with tempfile.TemporaryDirectory() as tmp:
        with replay_server(Path(tmp), _CONFIG) as address:
            client = ReplayClient(address, timeout=120)
            _fill(lambda rows: client.insert(KIND, rows))
            for path, shm in (("shared memory", True), ("grpc", False)):
                measure(path, lambda shm=shm: client.stream(
                    KIND, w.SAMPLE_BATCH, prefetch=PREFETCH, shared_memory=shm, device=device))
            client.close()
    return results


def table(results: dict[str, dict], device: str | None, cpu_step: str) -> str:
    import torch

    executor = "GPU (CUDA events)" if device else f"host ({cpu_step} step; time waiting in next())"
    head = (f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}; Atari rows "
            f"({w.row_bytes(KIND):,} bytes), batch {w.SAMPLE_BATCH}, prefetch {PREFETCH}, "
            f"delivered to {device or 'host memory'}; idle fraction of the {executor}\n\n")
    lines = ["| path, step | transport | fed loop s | preloaded loop s | ratio | idle (fed) | idle (preloaded) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['transport']} | {r['fed']['seconds']:.3f} | "
                     f"{r['preloaded']['seconds']:.3f} | {r['ratio']:.3f} | "
                     f"{r['fed']['idle_fraction']:.1%} | {r['preloaded']['idle_fraction']:.1%} |")
    return head + "\n".join(lines)


def main() -> None:
    global PREFILL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda: a GPU step on batches delivered to the GPU")
    parser.add_argument("--steps-ms", default="2,10", help="step lengths in ms, comma-separated")
    parser.add_argument("--batches", type=int, default=150, help="steps per loop")
    parser.add_argument("--cpu-step", default="sleep", choices=("sleep", "spin"),
                        help="without --device: how the host step spends its time")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--prefill", type=int, default=PREFILL,
                        help="rows inserted before measuring (fewer: quicker, for make gpu-check's "
                             "short run; the figures then come from a smaller table)")
    args = parser.parse_args()
    PREFILL = args.prefill
    if args.device is not None and args.device.split(":")[0] != "cuda":
        parser.error(f"--device must be cuda (or omitted), got {args.device!r}")
    steps_ms = [float(s) for s in args.steps_ms.split(",") if s.strip()]
    results = ours(steps_ms, args.batches, args.device, args.cpu_step)
    print(table(results, args.device, args.cpu_step))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
