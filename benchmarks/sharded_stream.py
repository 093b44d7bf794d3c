"""A learner's stream over shards, without Ray: batches per second and the CPU a batch costs.

    python benchmarks/sharded_stream.py
    python benchmarks/sharded_stream.py --baseline-tree /tmp/base   (a checkout to compare)

For each shard count of ``--shards`` (default 1 and 2): that many servers
(each its own process, shard 0..n-1, one prioritized table of 100,000 small
rows: 17 float32 + action + reward, as ``benchmarks/ray_buffers.py``), then
one learner process streaming ``--batches`` batches of 256 from
``ReplayClient([addresses]).stream`` (its grouping and window left to it),
after two batches untimed. Each run prints batches per second, the learner
process's CPU per batch (``time.process_time``: every thread, gRPC's
included) and the servers' CPU per batch (their ``/proc`` counters over the
same window). With ``--baseline-tree`` each round runs that tree's packages
(learner and servers) and this checkout's, one after the other, their order
reversed every other round (``baseline``, ``this``, ``this``, ``baseline``,
... for ``--rounds`` rounds), and the medians and the median of the rounds'
ratios are printed.

On 2 cores the servers and the learner share the machine: the figures are
of the whole, and a change that costs the learner less may show as more
batches per second only where the learner was what the cores waited for.
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
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sides import median_ratio, shard_servers, tree_envs  # noqa: E402

ROWS = 100_000
BATCH = 256


def _config(shard: int) -> str:
    return (f"[server]\nshard = {shard}\n"
            f'[[tables]]\nname = "small"\ncapacity = {ROWS}\nsampler = "prioritized"\n'
            f"alpha = 0.6\nbeta = 0.4\n")


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_pids(parent: int) -> list[int]:
    """The ``replay-server serve`` processes started by process ``parent``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"replay_server.app.cli" in command:
            pids.append(int(entry.name))
    return pids


def _worker(addresses: list[str], servers: list[int], batches: int) -> dict:
    """Fill the shards to ``ROWS`` rows, then time ``batches`` streamed batches of 256."""
    import torch
    from replay_client import ReplayClient

    with ReplayClient(addresses) as client:
        missing = ROWS - client.info()["small"].size
        for start in range(0, max(0, missing), 10_000):
            n = min(10_000, missing - start)
            client.insert("small", {"obs": torch.randn(n, 17), "action": torch.arange(n) % 6,
                                    "reward": torch.rand(n)})
        stream = client.stream("small", BATCH, num_batches=batches + 2)
        it = iter(stream)
        next(it), next(it)  # open, grouping chosen, the window filling
        served = sum(_cpu_s(pid) for pid in servers)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in it:
            pass
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        served = sum(_cpu_s(pid) for pid in servers) - served
        notes = list(stream.stats.notes)
        stream.close()
    return {"batches_per_s": batches / wall, "learner_cpu_us_per_batch": cpu / batches * 1e6,
            "servers_cpu_us_per_batch": served / batches * 1e6, "notes": notes}


def _run(shards: int, batches: int, env: dict[str, str]) -> dict:
    """One run: ``shards`` servers and a learner, all of ``env``'s packages."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the servers are started from this process's environment
    try:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            addresses = shard_servers(stack, Path(tmp), shards, _config)
            out = subprocess.run(
                [sys.executable, __file__, "--worker", "--addresses", ",".join(addresses),
                 "--servers", ",".join(map(str, _server_pids(os.getpid()))),
                 "--batches", str(batches)],
                capture_output=True, text=True, check=True, timeout=600, env=env)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2")
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--addresses", default="")
    parser.add_argument("--servers", default="")
    args = parser.parse_args()
    if args.worker:
        servers = [int(p) for p in args.servers.split(",") if p]
        print(json.dumps(_worker(args.addresses.split(","), servers, args.batches)))
        return
    sides = tree_envs(args.baseline_tree)
    report: dict = {"cores": os.cpu_count(), "batches": args.batches,
                    "load_before": os.getloadavg(), "runs": []}
    keys = ("batches_per_s", "learner_cpu_us_per_batch", "servers_cpu_us_per_batch")
    for n in [int(x) for x in args.shards.split(",")]:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            order = list(sides.items())
            for side, env in order if round_ % 2 == 0 else order[::-1]:
                run = _run(n, args.batches, env)
                runs[side].append(run)
                report["runs"].append({"shards": n, "side": side, "round": round_, **run})
                print(f"shards={n} round={round_} {side:8s} {run['batches_per_s']:8.0f} "
                      f"batches/s  learner {run['learner_cpu_us_per_batch']:5.0f} us/batch  "
                      f"servers {run['servers_cpu_us_per_batch']:5.0f} us/batch", flush=True)
        med = {side: {k: statistics.median(r[k] for r in rs) for k in keys}
               for side, rs in runs.items()}
        line = "  ".join(f"{side}: {m['batches_per_s']:.0f} batches/s, learner "
                         f"{m['learner_cpu_us_per_batch']:.0f} us, servers "
                         f"{m['servers_cpu_us_per_batch']:.0f} us" for side, m in med.items())
        if "baseline" in med:
            rate = median_ratio(runs["this"], runs["baseline"], "batches_per_s")
            line += f"  | this/baseline, median of rounds: batches/s {rate:.2f}"
        print(f"shards={n} medians  {line}", flush=True)
    report["load_after"] = os.getloadavg()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
