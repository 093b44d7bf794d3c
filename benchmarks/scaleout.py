"""Scale-out benchmark: aggregate insert and sample rates over 1, 2 and 4 shards, and the
merged-sampling latency of a sharded client at one shard against a plain client.

    python benchmarks/scaleout.py            (or: make bench-scaleout)

For each shard count ``n``: ``n`` servers (each its own process, shard 0..n-1,
one prioritized table of small rows, 17 float32), driven by ``n`` client
processes at once (one per shard), each a sharded client over all ``n``
servers: first inserting 8,192-row chunks (round-robin over the shards), then
sampling batches of 256 with ``sample`` (each batch split across all shards
by mass and merged: one call per shard per batch), then streaming them with
``stream(batches_per_message=8)`` (one call per shard per 8 batches). Rates are summed over the client processes, which start together
and run for the same time. Then, against one server in one process, blocks
of ``sample(256)`` by ``ReplayClient(address)`` and by
``ReplayClient([address])`` alternate; the median call latency of each and
their ratio are printed (target: the sharded one at most 1.3x).

    git worktree add --detach ../base <commit>
    python benchmarks/scaleout.py --baseline-tree ../base

compares instead the plain one-server client (and its server) of this
checkout with another tree's: median ``sample(256)`` and
``insert(8192 rows)`` latency, the two alternating for ``--rounds`` rounds
(what sharding costs a one-server user: nothing, it should say).

Scaling needs cores: ``n`` servers and ``n`` clients each want one. On a
machine with fewer cores than ``2n`` the figures measure contention, not
scale-out (the JSON says how many cores there were).
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

from sides import replay_server, shard_servers  # noqa: E402

ROW_FLOATS = 17
CAPACITY = 1_000_000
PREFILL = 200_000  # rows over all shards before sampling
INSERT_CHUNK = 8192
BATCH = 256
GROUP = 8  # batches per round of the stream measurement


def _config(shard: int) -> str:
    return (f"[server]\nshard = {shard}\nworkers = 2\n"
            f'[[tables]]\nname = "small"\ncapacity = {CAPACITY}\nsampler = "prioritized"\n'
            f"alpha = 0.6\nbeta = 0.4\n")


def _worker(case: str, addresses: list[str], seconds: float, start_at: float, seed: int) -> dict:
    """One client process: insert or sample for ``seconds`` from ``start_at``; its rows/s."""
    import numpy as np
    import torch

    from replay_client import ReplayClient

    torch.set_num_threads(1)
    client = ReplayClient(addresses, timeout=120, seed=seed)
    client.info()  # connect and discover before the clock starts
    rows = {"obs": torch.from_numpy(
        np.random.default_rng(seed).standard_normal((INSERT_CHUNK, ROW_FLOATS), dtype=np.float32))}
    if case != "insert":
        client.sample("small", BATCH)
    time.sleep(max(0.0, start_at - time.time()))
    start, done = time.perf_counter(), 0
    if case == "stream":  # rounds of 8 batches (batches_per_message), the learner's path
        with client.stream("small", BATCH, batches_per_message=GROUP) as stream:
            for batch in stream:
                done += batch.batch_size
                if time.perf_counter() - start >= seconds:
                    break
    while case != "stream" and time.perf_counter() - start < seconds:
        if case == "insert":
            client.insert("small", rows)
            done += INSERT_CHUNK
        else:
            client.sample("small", BATCH)
            done += BATCH
    elapsed = time.perf_counter() - start
    client.close()
    return {"rows_per_s": done / elapsed, "seconds": elapsed}


def _drive(case: str, addresses: list[str], seconds: float) -> dict:
    """``len(addresses)`` worker processes at once; their summed rate."""
    start_at = time.time() + 3.0  # time for every worker to import and connect
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", case, "--addresses", ",".join(addresses),
         "--seconds", str(seconds), "--start-at", str(start_at), "--seed", str(i)],
        stdout=subprocess.PIPE, text=True) for i in range(len(addresses))]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"{case} worker failed ({proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"rows_per_s": sum(r["rows_per_s"] for r in results),
            "per_process": [round(r["rows_per_s"]) for r in results]}


def _prefill(addresses: list[str]) -> None:
    import numpy as np
    import torch

    from replay_client import ReplayClient

    with ReplayClient(addresses, timeout=120) as client:
        rows = torch.from_numpy(np.random.default_rng(0).standard_normal(
            (INSERT_CHUNK, ROW_FLOATS), dtype=np.float32))
        for first in range(0, PREFILL, INSERT_CHUNK):
            client.insert("small", {"obs": rows}, priorities=torch.rand(INSERT_CHUNK) + 0.01)


def _latency(address: str, blocks: int, calls: int) -> dict:
    """Median ``sample(256)`` latency, plain client vs sharded client over the one server."""
    from replay_client import ReplayClient

    plain, sharded = ReplayClient(address, timeout=120), ReplayClient([address], timeout=120)
    times: dict[str, list[float]] = {"plain": [], "sharded": []}
    for client in (plain, sharded):
        for _ in range(20):
            client.sample("small", BATCH)  # warm up
    for _ in range(blocks):
        for name, client in (("plain", plain), ("sharded", sharded)):
            for _ in range(calls):
                start = time.perf_counter()
                client.sample("small", BATCH)
                times[name].append(time.perf_counter() - start)
    plain.close()
    sharded.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"plain_ms": med["plain"] * 1e3, "sharded_ms": med["sharded"] * 1e3,
            "ratio": med["sharded"] / med["plain"], "calls_each": blocks * calls}


def _plain(seconds: float) -> dict:
    """One server and the plain one-server client, in this interpreter's checkout: median
    ``sample(256)`` and ``insert(8192 rows)`` latency (for ``--baseline-python``)."""
    import numpy as np
    import torch

    from replay_client import ReplayClient

    torch.set_num_threads(1)
    rows = {"obs": torch.from_numpy(np.random.default_rng(0).standard_normal(
        (INSERT_CHUNK, ROW_FLOATS), dtype=np.float32))}
    with tempfile.TemporaryDirectory() as tmp, replay_server(Path(tmp), _config(0)) as address:
        client = ReplayClient(address, timeout=120)
        times: dict[str, list[float]] = {"insert": [], "sample": []}
        for first in range(0, PREFILL, INSERT_CHUNK):
            start = time.perf_counter()
            client.insert("small", rows)
            times["insert"].append(time.perf_counter() - start)
        for _ in range(20):
            client.sample("small", BATCH)
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            start = time.perf_counter()
            client.sample("small", BATCH)
            times["sample"].append(time.perf_counter() - start)
        client.close()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _baseline(tree: Path, rounds: int, seconds: float) -> dict:
    """The plain client and server of this checkout against another tree's, interleaved.

    The other tree's packages are put first on ``PYTHONPATH`` (server and
    client alike: the server process inherits it); same interpreter and
    dependencies, so the code is all that differs.
    """
    roots = [tree / part for part in ("proto", "feed", "server", "client")]
    missing = [str(r) for r in roots if not r.is_dir()]
    if missing:
        raise SystemExit(f"--baseline-tree {tree}: no {missing} (a replay-server checkout?)")
    envs = {"this": dict(os.environ),
            "baseline": {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, roots))}}
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    for _ in range(rounds):
        for side, env in envs.items():
            out = subprocess.run([sys.executable, __file__, "--worker", "plain",
                                  "--seconds", str(seconds)],
                                 capture_output=True, text=True, check=True, timeout=600, env=env)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("insert", "sample")}
           for side, rs in runs.items()}
    return {"sample_ms": {s: round(m["sample"], 3) for s, m in med.items()},
            "insert_8192_ms": {s: round(m["insert"], 3) for s, m in med.items()},
            "sample_ratio": round(med["this"]["sample"] / med["baseline"]["sample"], 3),
            "insert_ratio": round(med["this"]["insert"] / med["baseline"]["insert"], 3),
            "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--latency-blocks", type=int, default=10)
    parser.add_argument("--worker", choices=("insert", "sample", "stream", "plain"))
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout (e.g. `git worktree add --detach ../base main`): "
                             "compare the plain one-server client and server of both, then exit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--addresses", default="")
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker == "plain":
        print(json.dumps(_plain(args.seconds)))
        return
    if args.worker:
        print(json.dumps(_worker(args.worker, args.addresses.split(","), args.seconds,
                                 args.start_at, args.seed)))
        return
    if args.baseline_tree:
        print(json.dumps(_baseline(args.baseline_tree, args.rounds, args.seconds), indent=1))
        return
    report: dict = {"cores": os.cpu_count(), "row": f"{ROW_FLOATS} float32, prioritized",
                    "seconds": args.seconds, "runs": []}
    for n in [int(x) for x in args.shards.split(",")]:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            addresses = shard_servers(stack, Path(tmp), n, _config)
            insert = _drive("insert", addresses, args.seconds)
            for address in addresses:
                from replay_client import ReplayClient

                with ReplayClient(address) as one:
                    one.reset("small")
            _prefill(addresses)
            sample = _drive("sample", addresses, args.seconds)
            stream = _drive("stream", addresses, args.seconds)
            run = {"shards": n, "insert_rows_per_s": round(insert["rows_per_s"]),
                   "sample_rows_per_s": round(sample["rows_per_s"]),
                   "stream_rows_per_s": round(stream["rows_per_s"]),
                   "insert_per_process": insert["per_process"],
                   "sample_per_process": sample["per_process"],
                   "stream_per_process": stream["per_process"]}
            if n == 1:
                run["latency_at_one_shard"] = _latency(addresses[0], args.latency_blocks, 50)
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
    base = report["runs"][0]
    for run in report["runs"]:
        run["insert_vs_first"] = round(run["insert_rows_per_s"] / base["insert_rows_per_s"], 2)
        run["sample_vs_first"] = round(run["sample_rows_per_s"] / base["sample_rows_per_s"], 2)
        run["stream_vs_first"] = round(run["stream_rows_per_s"] / base["stream_rows_per_s"], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
