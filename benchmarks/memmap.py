"""Memmap benchmark: memory-mapped tables against in-RAM tables and TorchRL's LazyMemmapStorage.

    python benchmarks/memmap.py --torchrl-python .venv-torchrl/bin/python [--repeat 3]
    python benchmarks/memmap.py --big-gb 46 --dir /path/on/local/disk   # larger than RAM

In-process engine measurements (uniform sampling, batch 256, rows/s):

* ``resident``: the same table (Atari rows, 84x84x4 uint8 + action, reward,
  done: 28 KB; 50,000 rows, 1.4 GB) in RAM and memory-mapped, its files in
  the page cache (the fill put them there): the memmap/RAM ratio.
* ``torchrl``: 10M small rows (17 float32) in a memmap table against
  TorchRL's ``LazyMemmapStorage`` + ``ReplayBuffer.sample()`` at 10M rows
  (``benchmarks/torchrl_memmap.py`` in its own virtualenv), side by side.
* ``--big-gb G``: a memmap table of G GB of Atari rows (size it to the disk:
  ``df -h`` first) fills and samples; prints fill and sample rows/s and the
  process's peak RSS, which stays far below the table.

Each repetition runs all sides; medians at the end. Files go under ``--dir``
(default: a temporary directory) and are removed by the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine_rates import report_medians, sample_rate  # noqa: E402
from sides import run_side  # noqa: E402

ATARI_ROWS = 50_000
SMALL_ROWS = 10_000_000


def _atari(n: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"obs": torch.randint(0, 255, (n, 84, 84, 4), dtype=torch.uint8, generator=generator),
            "action": torch.randint(0, 18, (n,), dtype=torch.int32, generator=generator),
            "reward": torch.randn(n, generator=generator),
            "done": torch.rand(n, generator=generator) < 0.01}


def _table(capacity: int, storage_dir: str | None):
    from replay_server.engine.config import TableConfig
    from replay_server.engine.table import Table

    extra = {} if storage_dir is None else {"storage": "memmap", "storage_dir": storage_dir}
    return Table(TableConfig(name="bench", capacity=capacity, seed=0, **extra))


def _fill(table, rows: int, chunk: dict[str, torch.Tensor]) -> float:
    size = next(iter(chunk.values())).shape[0]
    start = time.perf_counter()
    for first in range(0, rows, size):
        n = min(size, rows - first)
        table.insert({k: v[:n] for k, v in chunk.items()})
    return rows / (time.perf_counter() - start)


def resident(directory: str, seconds: float) -> dict:
    chunk = _atari(1024, 0)
    ram = _table(ATARI_ROWS, None)
    _fill(ram, ATARI_ROWS, chunk)
    mapped = _table(ATARI_ROWS, directory)
    _fill(mapped, ATARI_ROWS, chunk)
    os.sync()  # the fill's dirty pages written back: no writeback competes with the samples
    # Alternated, each twice, so a busy spell on the shared machine hits both sides.
    halves = [(sample_rate(ram, seconds / 2), sample_rate(mapped, seconds / 2))
              for _ in range(2)]
    rates = {"ram": sum(h[0] for h in halves) / 2, "memmap": sum(h[1] for h in halves) / 2}
    return {"resident_ram_rows_per_s": rates["ram"], "resident_memmap_rows_per_s": rates["memmap"],
            "resident_ratio": rates["memmap"] / rates["ram"]}


def small(directory: str, seconds: float, torchrl_python: str | None) -> dict:
    table = _table(SMALL_ROWS, directory)
    fill = _fill(table, SMALL_ROWS, {"obs": torch.randn(1_000_000, 17)})
    os.sync()
    ours = sample_rate(table, seconds)
    del table
    result = {"small_fill_rows_per_s": fill, "small_memmap_rows_per_s": ours}
    if torchrl_python:
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            theirs = run_side([torchrl_python, str(HERE / "torchrl_memmap.py"), "--rows",
                               str(SMALL_ROWS), "--dir", scratch, "--seconds", str(seconds)], 900)
        if theirs is not None:
            result["torchrl_fill_rows_per_s"] = theirs["fill_rows_per_s"]
            result["torchrl_memmap_rows_per_s"] = theirs["sample_rows_per_s"]
            result["vs_torchrl"] = ours / theirs["sample_rows_per_s"]
    return result


def big(directory: str, gigabytes: float, seconds: float) -> dict:
    row = 84 * 84 * 4 + 4 + 4 + 1
    capacity = int(gigabytes * 1e9) // row
    table = _table(capacity, directory)
    chunk = _atari(1024, 1)
    fill = _fill(table, capacity, chunk)
    rate = sample_rate(table, seconds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"big_rows": capacity, "big_gb": capacity * row / 1e9, "big_fill_rows_per_s": fill,
            "big_sample_rows_per_s": rate, "big_peak_rss_gb": peak / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchrl-python", help="python of TorchRL's virtualenv")
    parser.add_argument("--dir", help="where the files go (default: a temporary directory)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--big-gb", type=float, help="only the larger-than-RAM fill and sample")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    np.random.seed(0)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for repetition in range(1 if args.big_gb else args.repeat):
            if args.big_gb:
                record = big(directory, args.big_gb, args.seconds)
            else:
                record = {**resident(directory, args.seconds),
                          **small(directory, args.seconds, args.torchrl_python)}
            print(f"[{repetition}] " + json.dumps(record), flush=True)
            runs.append(record)
    report_medians({key: [r[key] for r in runs] for key in runs[0]}, args.json)


if __name__ == "__main__":
    main()
