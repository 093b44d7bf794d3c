"""Queue benchmark: insert-and-consume through a FIFO queue table, replay-server against Reverb.

    python benchmarks/queue_tables.py --reverb-python .venv-reverb/bin/python [--repeat 3]

Each side runs its server in its own process and one client process with an
actor thread inserting small rows (17 float32) into a queue of at most
10,000 rows (inserts wait when it is full) while the main thread takes them
in order in batches of 256, over 127.0.0.1. Reverb: ``Table.queue``, legacy
writer per step, ``TrajectoryDataset`` (``benchmarks/reverb_queue.py``). Ours:
a ``fifo`` table with ``max_size``, the actor's ``Writer`` per step (or
``insert`` of 256 rows per call), the learner's ``client.stream``. Prints rows
consumed per second (first insert to last row taken) and the ratio ours /
Reverb per repetition, then the medians; ours also checks every row came out
once, in order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import queue_workload as q  # noqa: E402
from sides import replay_server, run_side  # noqa: E402

_CONFIG = (f'[server]\nworkers = 2\n[[tables]]\nname = "queue"\ncapacity = {q.QUEUE_MAX}\n'
           f'sampler = "fifo"\nmax_size = {q.QUEUE_MAX}\n')


def _ours(rows: int, seconds: float, api: str) -> dict:
    import torch

    from replay_client import ReplayClient

    torch.set_num_threads(1)
    data = torch.from_numpy(q.make_rows(rows))
    with tempfile.TemporaryDirectory() as tmp, replay_server(Path(tmp), _CONFIG) as address:
        client = ReplayClient(address, timeout=120)
        deadline = time.perf_counter() + seconds

        def actor() -> None:
            actor_client = ReplayClient(address, timeout=120)
            if api == "writer":
                with actor_client.writer("queue", batch_rows=q.BATCH, episode_key=None) as w:
                    for i in range(rows):
                        w.append({"obs": data[i]})
                        if i % 1024 == 0 and time.perf_counter() > deadline:
                            break
            else:
                for first in range(0, rows, q.BATCH):
                    actor_client.insert("queue", {"obs": data[first:first + q.BATCH]})
                    if time.perf_counter() > deadline:
                        break

        start = time.perf_counter()
        thread = threading.Thread(target=actor)
        thread.start()
        taken = []
        for batch in client.stream("queue", q.BATCH, num_batches=rows // q.BATCH,
                                   wait_timeout=10):
            taken.append(batch.data["obs"][:, 0].clone())
            if time.perf_counter() > deadline:
                break
        elapsed = time.perf_counter() - start
        thread.join(timeout=120)
        order = torch.cat(taken)
        assert torch.equal(order, torch.arange(len(order), dtype=torch.float32)), "out of order"
        name = ("Writer.append per step" if api == "writer" else f"insert {q.BATCH} rows per call")
        return {"side": "ours", "api": f"{name} + stream (batch {q.BATCH})", "rows": len(order),
                "rows_per_s": len(order) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", help="python of Reverb's virtualenv")
    parser.add_argument("--rows", type=int, default=q.ROWS)
    parser.add_argument("--seconds", type=float, default=q.SECONDS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {}
    for repetition in range(args.repeat):
        results = [_ours(args.rows, args.seconds, "writer"), _ours(args.rows, args.seconds, "insert")]
        if args.reverb_python:
            reverb = run_side([args.reverb_python, str(HERE / "reverb_queue.py"), "--rows",
                               str(args.rows), "--seconds", str(args.seconds)], timeout=900)
            if reverb is not None:
                results.append(reverb)
        base = next((r["rows_per_s"] for r in results if r["side"] == "reverb"), None)
        for record in results:
            ratio = "" if base is None else f"  {record['rows_per_s'] / base:5.2f}x Reverb"
            print(f"[{repetition}] {record['side']:6} {record['api']:60} "
                  f"{record['rows_per_s']:>12,.0f} rows/s{ratio}", flush=True)
            runs.setdefault(f"{record['side']}: {record['api']}", []).append(record["rows_per_s"])
    medians = {name: statistics.median(values) for name, values in runs.items()}
    base = next((v for k, v in medians.items() if k.startswith("reverb")), None)
    print("\nmedians")
    for name, value in medians.items():
        ratio = "" if base is None else f"  {value / base:5.2f}x Reverb"
        print(f"  {name:68} {value:>12,.0f} rows/s{ratio}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
