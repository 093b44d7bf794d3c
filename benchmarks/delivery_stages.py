"""Where an in-process learner stream of Atari batches spends its time, stage by stage.

    python benchmarks/delivery_stages.py [--seconds 1] [--json PATH]

On an H200 host (16 cores) the in-process stream delivered 938 batches/s of
256 Atari rows to host memory, no more than on 2 cores (docs/benchmarks.md,
"GPU"). This times each stage alone, on the same table as
``benchmarks/learner.py`` (prioritized, 20,000 rows of 28 KB), so a GPU
machine's run says which one sets that rate:

* ``draw``: the sampler's draw and the table's bookkeeping, on a table of the
  same sampler and row count whose rows are one float (no gather to speak of);
* ``sample``: ``Table.sample(256, out=staging)``: the draw plus the gather into
  a preallocated (pinned, where CUDA is) staging batch, as the stream does;
* ``gather xN``: the frame column's gather alone (``take_rows`` of 256 random
  rows out of the 20,000) split over N threads (1, 2, 4, 8 where the machine
  has them), the rows new each time (out of cache, as in a stream);
* ``stream``: ``stream_table`` over the same table, batches to host memory.

Each figure is the median of per-call times over ``--seconds``, with calls per
second beside it. Machine, cores and torch are printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_workload as w  # noqa: E402

KIND = "atari"
ROWS = 20_000
BATCH = 256


def _time(call: Callable[[], Any], seconds: float) -> dict[str, float]:
    for _ in range(5):
        call()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and len(times) < 100_000:
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "per_s": 1 / median, "calls": len(times)}


def _table(rows: dict[str, Any] | None) -> Any:
    import torch

    from replay_server import Table, TableConfig

    table = Table(TableConfig(name=KIND, capacity=w.CAPACITY[KIND], sampler="prioritized",
                              alpha=w.ALPHA, beta=w.BETA))
    for first in range(0, ROWS, 1_000):
        chunk = w.make_rows(KIND, first, 1_000) if rows is None else {
            key: value[first:first + 1_000] for key, value in rows.items()}
        table.insert({key: torch.from_numpy(value) for key, value in chunk.items()})
    return table


def measure(seconds: float) -> dict[str, Any]:
    import numpy as np
    import torch

    from replay_server.app.embedded import stream_table
    from replay_server.engine import workers

    cuda = torch.cuda.is_available()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"machine": platform.machine(), "cores": os.cpu_count(),
                           "split_threads": workers.THREADS, "torch": torch.__version__,
                           "cuda": torch.cuda.get_device_name(0) if cuda else None}
    small = _table({"x": np.zeros((ROWS, 1), dtype=np.float32)})
    out["draw"] = _time(lambda: small.sample(BATCH), seconds)
    table = _table(None)
    layout = table.batch_layout(BATCH)
    staging = {key: torch.empty(shape, dtype=dtype, pin_memory=cuda)
               for key, (dtype, shape) in layout.items()}
    out["sample"] = _time(lambda: table.sample(BATCH, out=staging), seconds)
    frames = np.random.default_rng(0).integers(0, 256, (ROWS, 84, 84, 4), dtype=np.uint8)
    into = np.empty((BATCH, 84, 84, 4), dtype=np.uint8)
    rng = np.random.default_rng(1)
    for parts in (1, 2, 4, 8):
        if parts > workers.THREADS:
            break

        def gather(parts: int = parts) -> None:
            rows = rng.integers(0, ROWS, BATCH)
            bounds = np.linspace(0, BATCH, parts + 1).astype(int)
            tasks = list(zip(bounds[:-1], bounds[1:]))
            workers.run_split(lambda t: np.take(frames, rows[t[0]:t[1]], axis=0,
                                                out=into[t[0]:t[1]], mode="clip"), tasks, parts)
        out[f"gather x{parts}"] = _time(gather, seconds)
    with stream_table(table, BATCH) as stream:
        out["stream"] = _time(lambda: next(stream), seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.seconds)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
