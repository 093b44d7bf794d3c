"""TorchRL side of the memmap benchmark (run in the ``.venv-torchrl`` virtualenv).

    .venv-torchrl/bin/python benchmarks/torchrl_memmap.py --rows N --dir DIR [--seconds S]

``ReplayBuffer(storage=LazyMemmapStorage(N, scratch_dir=DIR), batch_size=256)``
(default RandomSampler and RoundRobinWriter), filled with N small rows
(``{"obs": 17 float32}`` TensorDicts, 1M rows per ``extend``), then
``rb.sample()`` timed for S seconds. Prints one JSON line (fill and sample
rows/s) on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TORCHRL_CONSOLE_STREAM", "stderr")
_JSON_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage, ReplayBuffer  # noqa: E402

BATCH = 256
CHUNK = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rb = ReplayBuffer(storage=LazyMemmapStorage(args.rows, scratch_dir=args.dir), batch_size=BATCH)
    chunk = TensorDict({"obs": torch.randn(min(CHUNK, args.rows), 17)}, batch_size=[min(CHUNK, args.rows)])
    start = time.perf_counter()
    for first in range(0, args.rows, CHUNK):
        n = min(CHUNK, args.rows - first)
        rb.extend(chunk[:n])
    fill = args.rows / (time.perf_counter() - start)
    os.sync()  # as our side: no writeback competes with the samples
    for _ in range(20):
        rb.sample()
    ops = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        rb.sample()
        ops += 1
    elapsed = time.perf_counter() - start
    _JSON_OUT.write(json.dumps({"side": "torchrl", "api": "LazyMemmapStorage + rb.sample()",
                                "rows": args.rows, "fill_rows_per_s": fill,
                                "sample_rows_per_s": ops * BATCH / elapsed}) + "\n")


if __name__ == "__main__":
    main()
