"""Stream A/B benchmark: one server's learner stream from two source trees, interleaved.

    python benchmarks/stream_ab.py --base DIR [--rounds 3] [--seconds 4] [--kinds atari,small]

``DIR`` is a checkout of the commit to compare against (``git worktree add`` or
``git archive COMMIT | tar -x -C DIR``); "new" is the tree this script is in.
Each measurement is a process of its own whose ``PYTHONPATH`` puts one tree's
packages first (``client``, ``feed``, ``proto``, ``server``), so the server it
starts and the client it streams with are that tree's; the same Python and
libraries run both. Sides alternate (base, new, then new, base, ...), so that
drift on a shared machine hits both alike; the median of ``--rounds`` is kept.

Each process fills a prioritized table (Atari frames, about 28 KB a row, or 17
floats) on a server of its own on 127.0.0.1 and counts batches of 256
delivered to host memory per second by ``client.stream(...)`` as a user calls
it (default prefetch; gRPC with ``shared_memory=False``, and the same-host
shared-memory ring), and with ``prefetch=2`` over gRPC.

``--cpu`` counts instead the CPU time per batch of both processes together
(the learner's and its server's, user + system, microseconds; lower is
better) over the batches of ``--seconds``: on a machine shared with other
work, a figure that moves far less with the load than a rate does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402
from stream_shapes import PREFILL, WARMUP_BATCHES, _config, _fill  # noqa: E402

PACKAGES = ("client", "feed", "proto", "server")
PATHS = {
    "gRPC": {"shared_memory": False},
    "gRPC, prefetch 2": {"shared_memory": False, "prefetch": 2},
    "shared memory": {"batches_per_message": 1},
}


def measure(kinds: list[str], seconds: float, cpu: bool = False) -> dict[str, float]:
    """Batches/s (``cpu``: CPU microseconds per batch, learner and server together) of each
    (kind, path) with this process's packages (one server per kind)."""
    import psutil
    import torch

    from replay_client import ReplayClient
    from sides import replay_server

    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp, \
                replay_server(Path(tmp), _config(kind, 0)) as address:
            client = ReplayClient(address, timeout=120)
            _fill(client, kind, PREFILL[kind])
            processes = [psutil.Process(), *psutil.Process().children()]
            for name, options in PATHS.items():
                with client.stream(kind, w.SAMPLE_BATCH, **options) as stream:
                    for _ in range(WARMUP_BATCHES):
                        next(stream)
                    used = _cpu_s(processes)
                    batches, start = 0, time.perf_counter()
                    while time.perf_counter() - start < seconds:
                        next(stream)
                        batches += 1
                    elapsed = time.perf_counter() - start
                    out[f"{kind} | {name}"] = ((_cpu_s(processes) - used) / batches * 1e6
                                               if cpu else batches / elapsed)
            client.close()
    return out


def _cpu_s(processes: list) -> float:
    """User + system CPU seconds of ``processes`` so far."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def side(tree: Path, kinds: list[str], seconds: float, cpu: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(tree / p) for p in PACKAGES))
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--measure", "--kinds", ",".join(kinds),
         "--seconds", str(seconds), *(["--cpu"] if cpu else [])],
        env=env, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="the tree to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--kinds", default=",".join(w.ROW_KINDS))
    parser.add_argument("--cpu", action="store_true",
                        help="CPU microseconds per batch (learner + server) instead of batches/s")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if args.measure:
        print(json.dumps(measure(kinds, args.seconds, args.cpu)))
        return
    if args.base is None:
        parser.error("--base DIR is required")
    trees = {"base": args.base.resolve(), "new": HERE.parent}
    runs: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    for round_ in range(args.rounds):
        order = ("base", "new") if round_ % 2 == 0 else ("new", "base")
        for name in order:
            for key, rate in side(trees[name], kinds, args.seconds, args.cpu).items():
                runs[name].setdefault(key, []).append(rate)
            print(f"round {round_ + 1} {name} done (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr)
    unit = "CPU us per batch" if args.cpu else "batches/s"
    print(f"| rows | path | base, {unit} (median) | new (median) | new / base | rounds base; new |")
    print("|---|---|---:|---:|---:|---|")
    for key in runs["base"]:
        base, new = runs["base"][key], runs["new"][key]
        b, n = statistics.median(base), statistics.median(new)
        each = (", ".join(f"{x:.0f}" for x in base) + "; " + ", ".join(f"{x:.0f}" for x in new))
        print(f"| {key} | {b:,.1f} | {n:,.1f} | {n / b:.2f}x | {each} |")


if __name__ == "__main__":
    main()
