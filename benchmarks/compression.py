"""Compression benchmark: lz4-compressed columns against the same table uncompressed.

    python benchmarks/compression.py [--repeat 3] [--seconds 5]

In process, uniform sampling, batch 256, 20,000 Atari-like rows (``obs``
``[4, 84, 84]`` uint8, action, reward, done). The frames are synthetic, made
to look like Atari screens to a compressor: a flat background with a few
moving rectangles (sprites), so the ratio is only an indication; random
frames would not compress at all. Prints the compression ratio and memory
held, insert rows/s, and sample rows/s of both tables (alternated twice per
repetition), and the ratios, then medians.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_rates import arguments, report_medians, sample_rate  # noqa: E402

ROWS = 20_000


def frames(n: int) -> torch.Tensor:
    """``n`` consecutive screens: background, and 6 rectangles that move one pixel a step."""
    generator = torch.Generator().manual_seed(0)
    out = torch.full((n + 3, 84, 84), 40, dtype=torch.uint8)
    corners = torch.randint(0, 70, (6, 2), generator=generator)
    colours = torch.randint(60, 255, (6,), generator=generator)
    for t in range(n + 3):
        for (y, x), colour in zip(((corners + t) % 70).tolist(), colours.tolist()):
            out[t, y:y + 10, x:x + 6] = colour
    return out


def main() -> None:
    args = arguments(__doc__)
    screens = frames(ROWS)
    obs = torch.stack([screens[t:t + 4] for t in range(ROWS)])
    data = {"obs": obs, "action": torch.zeros(ROWS, dtype=torch.int64),
            "reward": torch.zeros(ROWS), "done": torch.zeros(ROWS, dtype=torch.bool)}
    tables = {name: Table(TableConfig(name=name, capacity=ROWS, seed=0, **extra))
              for name, extra in (("plain", {}), ("lz4", {"compress_keys": ["obs"]}))}
    runs: dict[str, list[float]] = {}
    for name, table in tables.items():
        start = time.perf_counter()
        for first in range(0, ROWS, 256):
            table.insert({k: v[first:first + 256] for k, v in data.items()})
        runs[f"{name} insert rows/s"] = [ROWS / (time.perf_counter() - start)]
        runs[f"{name} bytes held"] = [float(table.info().storage_bytes)]
    runs["compression_ratio"] = [tables["lz4"].info().sampler_stats["compression_ratio"]]
    a, b = tables["plain"].sample(64), tables["lz4"].sample(64)
    assert torch.equal(a.data["obs"], b.data["obs"])
    for repetition in range(args.repeat):
        halves = [(sample_rate(tables["plain"], args.seconds / 2),
                   sample_rate(tables["lz4"], args.seconds / 2)) for _ in range(2)]
        plain, packed = (sum(h[i] for h in halves) / 2 for i in (0, 1))
        runs.setdefault("plain sample rows/s", []).append(plain)
        runs.setdefault("lz4 sample rows/s", []).append(packed)
        runs.setdefault("sample lz4 / plain", []).append(packed / plain)
        print(f"[{repetition}] plain {plain:>10,.0f} rows/s  lz4 {packed:>10,.0f} rows/s  "
              f"{packed / plain:.2f}x", flush=True)
    report_medians(runs, args.json)


if __name__ == "__main__":
    main()
