"""Small inserts through a sharded client: rows per second and the client's CPU per call.

    python benchmarks/sharded_insert.py
    python benchmarks/sharded_insert.py --baseline-tree /tmp/base   (a checkout to compare)

For 1 and 2 shards (``--shards``): that many servers (each its own process,
shard 0..n-1, one prioritized table), then one client process at a time
inserting ``--calls`` calls of 64 small rows (17 float32 + action + reward,
as ``benchmarks/ray_buffers.py``) through ``ReplayClient([addresses])``
(a sharded client; rows without an episode key go whole to the next shard
in turn, so every call reaches one shard), after ``--warmup`` calls untimed.
Each run prints rows per second and the client process's CPU per call
(``time.process_time``: every thread of the client process, gRPC's
included). With ``--baseline-tree`` the client runs alternate between that
tree's packages and this checkout's (``baseline``, ``this``, ``baseline``,
... for ``--rounds`` rounds, against the same servers, this checkout's),
and the medians and the median of the rounds' ratios are printed.

    python benchmarks/sharded_insert.py --inline-ab --calls 20000

measures instead, in one client process, this checkout's inline one-shard
insert against its pooled path (a client whose shards get no lane), in
alternating blocks of ``--block`` calls: on a loaded machine the A/B that
drifts least.
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

ROWS = 64


def _config(shard: int) -> str:
    return (f"[server]\nshard = {shard}\n"
            f'[[tables]]\nname = "small"\ncapacity = 1000000\nsampler = "prioritized"\n'
            f"alpha = 0.6\nbeta = 0.4\n")


def _worker(addresses: list[str], calls: int, warmup: int) -> dict:
    """Time ``calls`` inserts of 64 small rows through a sharded client over ``addresses``."""
    import torch
    from replay_client import ReplayClient

    data = {"obs": torch.randn(ROWS, 17), "action": torch.arange(ROWS) % 6,
            "reward": torch.rand(ROWS)}
    with ReplayClient(addresses) as client:
        for _ in range(warmup):
            client.insert("small", data)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            client.insert("small", data)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"rows_per_s": calls * ROWS / wall, "wall_us_per_call": wall / calls * 1e6,
            "cpu_us_per_call": cpu / calls * 1e6}


def _inline_ab(addresses: list[str], calls: int, warmup: int, block: int) -> dict:
    """This checkout's inline path against its pooled one, in one process: two sharded clients
    over ``addresses``, one whose shard clients hide their connection's type (so their
    inserts stay pooled, :mod:`replay_client.sharded.lanes`), alternating blocks of ``block``
    calls (load that drifts meets both alike); medians over blocks."""
    import torch
    from replay_client import ReplayClient
    from replay_client.server_client import ServerClient

    class Hidden:  # a connection that is no Connection: no lane, the probe still works
        def __init__(self, connection: object) -> None:
            self.unary = connection.unary  # type: ignore[attr-defined]

    class PooledOnly(ServerClient):
        @property
        def connection(self) -> Hidden:  # type: ignore[override]
            return Hidden(self._connection)

    data = {"obs": torch.randn(ROWS, 17), "action": torch.arange(ROWS) % 6,
            "reward": torch.rand(ROWS)}
    clients = {"pooled": ReplayClient(addresses, client=PooledOnly),
               "inline": ReplayClient(addresses)}
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in clients}
    try:
        for client in clients.values():
            for _ in range(warmup):
                client.insert("small", data)
        for _ in range(max(1, calls // block)):
            for side, client in clients.items():
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(block):
                    client.insert("small", data)
                times[side].append(((time.perf_counter() - wall) / block * 1e6,
                                    (time.process_time() - cpu) / block * 1e6))
    finally:
        for client in clients.values():
            client.close()
    out = {side: {"wall_us_per_call": statistics.median(w for w, _ in ts),
                  "cpu_us_per_call": statistics.median(c for _, c in ts),
                  "rows_per_s": ROWS * 1e6 / statistics.median(w for w, _ in ts)}
           for side, ts in times.items()}
    out["cpu_ratio_of_blocks"] = statistics.median(
        i[1] / p[1] for i, p in zip(times["inline"], times["pooled"]))
    out["blocks"] = len(times["inline"])
    return out


def _run(addresses: list[str], calls: int, warmup: int, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", "--addresses", ",".join(addresses),
                          "--calls", str(calls), "--warmup", str(warmup)],
                         capture_output=True, text=True, check=True, timeout=600, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--inline-ab", action="store_true",
                        help="this checkout's inline path against its pooled one, in one process")
    parser.add_argument("--block", type=int, default=200, help="--inline-ab: calls per block")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--addresses", default="")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.addresses.split(","), args.calls, args.warmup)))
        return
    if args.inline_ab:
        for n in [int(x) for x in args.shards.split(",")]:
            with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
                addresses = shard_servers(stack, Path(tmp), n, _config)
                result = _inline_ab(addresses, args.calls, args.warmup, args.block)
                print(json.dumps({"shards": n, "load": os.getloadavg(), **result}), flush=True)
        return
    sides = tree_envs(args.baseline_tree)
    report: dict = {"cores": os.cpu_count(), "calls": args.calls, "rows_per_call": ROWS,
                    "load_before": os.getloadavg(), "runs": []}
    for n in [int(x) for x in args.shards.split(",")]:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            addresses = shard_servers(stack, Path(tmp), n, _config)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for round_ in range(args.rounds):
                for side, env in sides.items():
                    run = _run(addresses, args.calls, args.warmup, env)
                    runs[side].append(run)
                    report["runs"].append({"shards": n, "side": side, "round": round_, **run})
                    print(f"shards={n} round={round_} {side:8s} "
                          f"{run['rows_per_s']:10.0f} rows/s  "
                          f"{run['wall_us_per_call']:7.0f} us/call  "
                          f"cpu {run['cpu_us_per_call']:6.0f} us/call", flush=True)
            med = {side: {k: statistics.median(r[k] for r in rs)
                          for k in ("rows_per_s", "cpu_us_per_call")} for side, rs in runs.items()}
            line = "  ".join(f"{side}: {m['rows_per_s']:.0f} rows/s, cpu {m['cpu_us_per_call']:.0f}"
                             f" us/call" for side, m in med.items())
            if "baseline" in med:
                rate = median_ratio(runs["this"], runs["baseline"], "rows_per_s")
                cpu = median_ratio(runs["this"], runs["baseline"], "cpu_us_per_call")
                line += f"  | this/baseline, median of rounds: rows/s {rate:.3f}, cpu {cpu:.3f}"
            print(f"shards={n} medians  {line}", flush=True)
    report["load_after"] = os.getloadavg()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
