"""What the in-process storage benchmarks share (memmap.py, nstep.py, framestack.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

BATCH = 256


def arguments(doc: str) -> argparse.Namespace:
    """The options every one of these benchmarks takes (``--seconds``, ``--repeat``, ``--json``);
    torch's own threads are limited to one, as the engine's are."""
    import torch

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args


def sample_rate(table, seconds: float, batch: int = BATCH) -> float:
    """Rows/s of ``table.sample(batch)`` for ``seconds`` (after 20 warm-up samples)."""
    for _ in range(20):
        table.sample(batch)
    ops, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        table.sample(batch)
        ops += 1
    return ops * batch / (time.perf_counter() - start)


def alternated_rates(tables: dict, seconds: float, slices: int = 10,
                     batch: int = BATCH) -> dict:
    """Rows/s of each table's ``sample(batch)``, ``seconds`` each, taken in ``slices`` turns.

    The tables take turns (each slice after 20 warm-up samples), so a busy
    spell on a shared machine hits every side about alike.
    """
    rates = {name: 0.0 for name in tables}
    for _ in range(slices):
        for name, table in tables.items():
            rates[name] += sample_rate(table, seconds / slices, batch) / slices
    return rates


def report_medians(runs: dict[str, list[float]], json_path: Path | None) -> dict[str, float]:
    """Print the median of each measurement (and write runs and medians to ``json_path``)."""
    medians = {key: statistics.median(values) for key, values in runs.items()}
    print("\nmedians")
    for key, value in medians.items():
        print(f"  {key:36} {value:>16,.2f}")
    if json_path:
        json_path.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
    return medians
