"""Ape-X read benchmark: ``sample(256)`` + ``update_priorities`` on the Ape-X table against a
plain table of the same rows, in one process, the two taking turns.

    python benchmarks/apex_read.py [--rows 20000] [--rounds 7] [--seconds 1.0] [--profile]

* ``apex``: ``deploy/configs/apex_atari.toml``'s table (prioritized, ``n_step = 3``,
  ``frame_stack_key = "obs"``: 4 stacked 84x84 uint8 frames stored one per step,
  both stored frames lz4-compressed).
* ``plain``: the same config storing the full stacks uncompressed, one-step rows.

Rows: :class:`flagship.Recorded`'s 8 interleaved actors, over the recorded Atari frames
when ``benchmarks/data/atari_frames.npz`` exists, else over synthetic screens drawn
like Atari ones (flat bands, a score bar, a few moving sprites; lz4 makes about 10x
less of them, as of real screens). A round runs each table ``--seconds`` (after 5
warm-up calls), alternating; each round gives both rates and their ratio; the medians
over ``--rounds`` are printed, with the machine's load (``os.getloadavg``) before and
after. ``--profile``: also the apex call's time split into sample and update.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from replay_server.engine.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flagship import Recorded, fill, shipped  # noqa: E402

BATCH = 256


def atari_like(count: int, seed: int = 0) -> np.ndarray:
    """``count`` 84x84 uint8 screens: flat bands, a score bar and sprites that move a
    pixel or two per frame (compress about as well as Atari screens under lz4)."""
    rng = np.random.default_rng(seed)
    background = np.repeat(rng.integers(0, 255, (12, 1), dtype=np.uint8), 7, axis=0)
    background = np.broadcast_to(background, (84, 84))
    frames = np.empty((count, 84, 84), dtype=np.uint8)
    sprites = rng.integers(0, 255, (6, 8, 6), dtype=np.uint8)
    start = rng.integers(0, 76, (6, 2))
    speed = rng.integers(-2, 3, (6, 2))
    for i in range(count):
        frame = frames[i]
        frame[:] = background
        frame[:6, 40:60] = (i // 10) % 250  # the score
        for s in range(6):
            y, x = (start[s] + speed[s] * i) % 76
            frame[y:y + 8, x:x + 6] = sprites[s]
    return frames


def call(table: Table, rng: np.random.Generator):
    def run() -> None:
        batch = table.sample(BATCH)
        table.update_priorities(batch.ids, torch.from_numpy(rng.random(BATCH) + 0.01))
    return run


def rate(op, seconds: float) -> tuple[float, float]:
    """Calls per second of ``op`` for ``seconds``, and the process's CPU time per call (every
    thread's: the decode's workers too; less sensitive to a loaded machine than the rate)."""
    for _ in range(5):
        op()
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        op()
        done += 1
    return done / (time.perf_counter() - start), (time.process_time() - cpu) / done


def profile(table: Table, calls: int = 200) -> None:
    rng = np.random.default_rng(2)
    sample = update = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        batch = table.sample(BATCH)
        middle = time.perf_counter()
        table.update_priorities(batch.ids, torch.from_numpy(rng.random(BATCH) + 0.01))
        sample += middle - start
        update += time.perf_counter() - middle
    print(f"apex split: sample {sample / calls * 1e3:.2f} ms, update "
          f"{update / calls * 1e3:.2f} ms per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    recorded = Recorded()
    if not recorded.real:
        recorded.frames = atari_like(len(recorded.frames))
    common = {"capacity": args.rows, "min_size_to_sample": None, "seed": 0}
    tables = {"apex": Table(shipped("apex_atari.toml", **common)),
              "plain": Table(shipped("apex_atari.toml", **common, n_step=1,
                                     frame_stack_key=None, compress_keys=None))}
    for table in tables.values():
        fill(table, recorded, args.rows)
    ratio = tables["apex"].info().sampler_stats.get("compression_ratio")
    print(f"frames: {'recorded Atari' if recorded.real else 'synthetic Atari-like'}, "
          f"{args.rows:,} rows, lz4 ratio {ratio}")
    print(f"load before: {os.getloadavg()}")
    rng = np.random.default_rng(1)
    ops = {name: call(table, rng) for name, table in tables.items()}
    rates: dict[str, list[float]] = {name: [] for name in ops}
    cpus: dict[str, list[float]] = {name: [] for name in ops}
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    for round_ in range(args.rounds):
        order = list(ops) if round_ % 2 == 0 else list(ops)[::-1]
        got = {name: rate(ops[name], args.seconds) for name in order}
        for name, (value, cpu) in got.items():
            rates[name].append(value)
            cpus[name].append(cpu)
        ratios.append(got["apex"][0] / got["plain"][0])
        cpu_ratios.append(got["plain"][1] / got["apex"][1])
        print(f"round {round_}: apex {got['apex'][0]:.1f}/s ({got['apex'][1] * 1e3:.2f} ms CPU), "
              f"plain {got['plain'][0]:.1f}/s ({got['plain'][1] * 1e3:.2f} ms CPU), "
              f"ratio {ratios[-1]:.2f}, CPU ratio {cpu_ratios[-1]:.2f}")
    print(f"load after: {os.getloadavg()}")
    median = statistics.median
    print(f"median: apex {median(rates['apex']):.1f}/s ({median(cpus['apex']) * 1e3:.2f} ms CPU "
          f"per call), plain {median(rates['plain']):.1f}/s ({median(cpus['plain']) * 1e3:.2f} "
          f"ms CPU); apex/plain rate {median(ratios):.2f}x (rounds {min(ratios):.2f}-"
          f"{max(ratios):.2f}), by CPU per call {median(cpu_ratios):.2f}x")
    if args.profile:
        profile(tables["apex"])


if __name__ == "__main__":
    main()
