"""Flagship benchmark: the Ape-X and R2D2 Atari tables (deploy/configs/) against plain tables
storing the full stacks, on real Atari frames, side by side in one process.

    /tmp/ale/bin/python benchmarks/atari_frames.py     # once: record real frames (own venv)
    python benchmarks/flagship.py [--apex-rows 50000] [--r2d2-rows 100000]
                                  [--r2d2-large 1000000] [--seconds 6] [--repeat 3]
                                  [--torchrl-python PATH [--torchrl-rows 300000]
                                   [--index-rows 10000000]]

Rows: 8 actors replay the recorded games (``benchmarks/data/atari_frames.npz``; without
it, synthetic screens, and the output says so) from different points, each step a
``[4, 84, 84]`` uint8 stack (the first frame repeated at an episode's start) with
``next.obs``, ``action``, ``reward``, ``done``, ``truncated`` and ``episode``.

* Ape-X: the config's table (prioritized, n_step 3, frame stacks, lz4) and two plain
  prioritized tables of the same rows: full stacks, and full stacks lz4-compressed.
  Bytes per row (storage held now plus per-slot state, over the rows), and
  ``sample(256)`` + ``update_priorities`` per second, the tables taking turns.
* R2D2: the config's table (prioritized_slice of 80 steps, frame stacks, lz4 on a
  memory-mapped file, small columns in RAM; rows without ``next.obs``) and a plain
  prioritized_slice table of full stacks in RAM, ``sample(64)`` (64 x 80 steps) per
  second, taking turns; then the config's table at ``--r2d2-large`` rows alone.
* R2D2 against TorchRL (``--torchrl-python``): the config's table and TorchRL's
  equivalent (``benchmarks/torchrl_slices.py``: LazyMemmapStorage +
  PrioritizedSliceSampler + CatFrames, in its own process and virtualenv), each alone
  in turn, ``sample(64)`` per second: at ``--torchrl-rows`` steps of Atari frames, and
  at ``--index-rows`` steps of small observations (``[4, 17]`` float32 stacks: the
  samplers' and indexes' cost at R2D2's 10M steps, which Atari frames would need
  70 GB of files for, per side).

The sizes are scaled to this machine's RAM (the plain tables hold 56 KB (Ape-X) or
28 KB (R2D2) per row in RAM); the figures per row and the ratios are what the
configs' full sizes would give, and the large R2D2 table shows the sample cost does
not grow with the rows stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import torch

from replay_server.app.config_file import settings_from_dict
from replay_server.engine.table import Table
from replay_server.engine.table_memory import sampler_slot_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sides import run_side  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "deploy" / "configs"
FRAMES = HERE / "data" / "atari_frames.npz"
ACTORS, STACK, CHUNK = 8, 4, 1000


def shipped(name: str, **changes):
    """The flagship config ``name``'s table, with ``changes`` (sizes, paths)."""
    document = tomllib.loads((CONFIGS / name).read_text())
    table = settings_from_dict(document).tables[0]
    return dataclasses.replace(table, **changes)


class Recorded:
    """Steps of ACTORS actors replaying the recorded games from different points (``small``:
    17 float32 observations in episodes of 1,000 steps instead)."""

    def __init__(self, small: bool = False) -> None:
        if small:
            self.frames = np.random.default_rng(0).standard_normal((20_000, 17)).astype(
                np.float32)
            starts, self.real = np.arange(0, 20_000, 1000), True
        elif FRAMES.exists():
            data = np.load(FRAMES)
            self.frames, starts, self.real = data["frames"], data["starts"], True
        else:
            rng = np.random.default_rng(0)
            self.frames = np.zeros((20_000, 84, 84), dtype=np.uint8)
            for i in range(0, 20_000, 50):
                block = rng.integers(0, 255, (84, 84), dtype=np.uint8) // 64 * 64
                self.frames[i:i + 50] = block
            starts, self.real = np.arange(0, 20_000, 1000), False
        n = len(self.frames)
        self.first = np.zeros(n, dtype=bool)
        self.first[starts] = True
        # the index of each frame's episode start, for stacks padded with the first frame
        self.start_of = np.maximum.accumulate(np.where(self.first, np.arange(n), 0))

    def rows(self, begin: int, count: int, with_next: bool = True) -> dict:
        """Steps ``begin .. begin + count - 1`` of the interleaved actors."""
        n = len(self.frames)
        step = np.arange(begin, begin + count)
        actor, t = step % ACTORS, step // ACTORS
        frame = (t + actor * (n // ACTORS)) % n
        lap = (t + actor * (n // ACTORS)) // n
        stack = np.maximum(frame[:, None] - np.arange(STACK - 1, -1, -1),
                           self.start_of[frame][:, None])
        following = (frame + 1) % n
        done = self.first[following]
        obs = self.frames[stack]
        data = {"obs": torch.from_numpy(obs),
                "action": torch.from_numpy((frame * 7 % 18).astype(np.int64)),
                "reward": torch.from_numpy(((frame % 13 == 0) * 1.0).astype(np.float32)),
                "done": torch.from_numpy(done),
                "episode": torch.from_numpy(actor * 1_000_000 + lap * 1000
                                            + np.searchsorted(np.flatnonzero(self.first),
                                                              frame, side="right"))}
        if with_next:
            nxt = np.concatenate([obs[:, 1:], self.frames[following][:, None]], axis=1)
            data["next"] = {"obs": torch.from_numpy(nxt)}
            data["truncated"] = torch.zeros(count, dtype=torch.bool)
        return data


def fill(table: Table, recorded: Recorded, rows: int, with_next: bool = True,
         chunk: int = CHUNK) -> float:
    """Insert ``rows`` steps in chunks; returns rows/s."""
    start = time.perf_counter()
    for begin in range(0, rows, chunk):
        table.insert(recorded.rows(begin, min(chunk, rows - begin), with_next))
    return rows / (time.perf_counter() - start)


def bytes_per_row(table: Table) -> float:
    info = table.info()
    return (info.storage_bytes + info.capacity * sampler_slot_bytes(table.config)) / info.size


def turns(ops: dict, seconds: float, slices: int = 6) -> dict[str, float]:
    """Calls per second of each op, taken in turns (a busy spell hits all alike)."""
    for op in ops.values():
        for _ in range(5):
            op()
    done = {name: 0 for name in ops}
    spent = {name: 0.0 for name in ops}
    for _ in range(slices):
        for name, op in ops.items():
            start = time.perf_counter()
            while time.perf_counter() - start < seconds / slices:
                op()
                done[name] += 1
            spent[name] += time.perf_counter() - start
    return {name: done[name] / spent[name] for name in ops}


def apex(recorded: Recorded, rows: int, seconds: float) -> dict:
    common = {"capacity": rows, "min_size_to_sample": None, "seed": 0}
    configs = {
        "apex": shipped("apex_atari.toml", **common),
        "plain": shipped("apex_atari.toml", **common, n_step=1, frame_stack_key=None,
                         compress_keys=None),
        "plain_lz4": shipped("apex_atari.toml", **common, n_step=1, frame_stack_key=None),
    }
    result: dict = {}
    tables = {}
    for name, config in configs.items():
        tables[name] = Table(config)
        result[f"{name}_insert_rows_per_s"] = fill(tables[name], recorded, rows)
        result[f"{name}_bytes_per_row"] = bytes_per_row(tables[name])
        print(f"  apex {name}: {result[f'{name}_bytes_per_row']:,.0f} bytes/row", file=sys.stderr)
    del tables["plain_lz4"]
    gc.collect()
    rng = np.random.default_rng(1)

    def op(table: Table):
        def call() -> None:
            batch = table.sample(256)
            table.update_priorities(batch.ids, torch.from_numpy(rng.random(256) + 0.01))
        return call

    rates = turns({name: op(table) for name, table in tables.items()}, seconds)
    result.update({f"{name}_sample_update_per_s": rate for name, rate in rates.items()})
    return result


def r2d2(recorded: Recorded, rows: int, large: int, seconds: float, directory: Path) -> dict:
    common = {"min_size_to_sample": None, "seed": 0, "storage_dir": str(directory)}
    configs = {
        "r2d2": shipped("r2d2_atari.toml", capacity=rows, **common),
        "plain": shipped("r2d2_atari.toml", capacity=rows, min_size_to_sample=None, seed=0,
                         frame_stack_key=None, compress_keys=None, storage="memory",
                         storage_dir=None, column_storage=None),
    }
    result: dict = {}
    tables = {}
    for name, config in configs.items():
        tables[name] = Table(config)
        result[f"{name}_insert_rows_per_s"] = fill(tables[name], recorded, rows, False)
        result[f"{name}_bytes_per_row"] = bytes_per_row(tables[name])
        print(f"  r2d2 {name}: {result[f'{name}_bytes_per_row']:,.0f} bytes/row", file=sys.stderr)
    rates = turns({name: (lambda t=table: t.sample(64)) for name, table in tables.items()},
                  seconds)
    result.update({f"{name}_sample_per_s": rate for name, rate in rates.items()})
    tables.clear()
    gc.collect()
    if large:
        table = Table(shipped("r2d2_atari.toml", capacity=large, **common))
        result["large_rows"] = large
        result["large_insert_rows_per_s"] = fill(table, recorded, large, False)
        result["large_bytes_per_row"] = bytes_per_row(table)
        result["large_sample_per_s"] = turns({"large": lambda: table.sample(64)},
                                             seconds)["large"]
    return result


def versus_torchrl(python: str, kind: str, rows: int, seconds: float, repeat: int) -> dict:
    """The R2D2 table and TorchRL's equivalent at ``rows`` steps of ``kind`` (``atari`` or
    ``small``), each alone in turn (ours in this process, TorchRL's in its own):
    ``sample(64)`` per second, medians over ``repeat`` turns each."""
    small = kind == "small"
    recorded = Recorded(small=small)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(dir=HERE / "data") as directory:
            changes = {"schema": None} if small else {}
            table = Table(shipped("r2d2_atari.toml", capacity=rows, min_size_to_sample=None,
                                  seed=0, storage_dir=directory, **changes))
            fill(table, recorded, rows, False, chunk=10 * CHUNK if small else CHUNK)
            ours.append(turns({"ours": lambda t=table: t.sample(64)}, seconds)["ours"])
            table = None
            gc.collect()
        with tempfile.TemporaryDirectory(dir=HERE / "data") as directory:
            side = run_side([python, str(HERE / "torchrl_slices.py"), "--rows", str(rows),
                             "--dir", directory, "--kind", kind, "--seconds", str(seconds)],
                            timeout=3600)
        if side is not None:
            theirs.append(side["sample_per_s"])
        print(f"  r2d2 vs torchrl, {kind} x {rows:,}: ours {ours[-1]:.2f}/s, torchrl "
              f"{theirs[-1] if side else float('nan'):.2f}/s", file=sys.stderr)
    result = {"ours_sample_per_s": statistics.median(ours)}
    if theirs:
        result["torchrl_sample_per_s"] = statistics.median(theirs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apex-rows", type=int, default=50_000)
    parser.add_argument("--r2d2-rows", type=int, default=100_000)
    parser.add_argument("--r2d2-large", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--repeat", type=int, default=3, help="rate measurements per table set")
    parser.add_argument("--only", choices=["apex", "r2d2", "torchrl"])
    parser.add_argument("--torchrl-python", help="TorchRL's virtualenv python: R2D2 against it")
    parser.add_argument("--torchrl-rows", type=int, default=300_000,
                        help="Atari-frame steps of the TorchRL comparison")
    parser.add_argument("--index-rows", type=int, default=10_000_000,
                        help="small-observation steps of the TorchRL comparison (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    recorded = Recorded()
    print(f"frames: {'real Atari (' + str(len(recorded.frames)) + ')' if recorded.real else 'SYNTHETIC'}")
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        results = {}
        if args.only in (None, "apex"):
            results.update({f"apex.{k}": v for k, v in apex(recorded, args.apex_rows,
                                                            args.seconds).items()})
        if args.only in (None, "r2d2"):
            with tempfile.TemporaryDirectory(dir=HERE / "data") as directory:
                results.update({f"r2d2.{k}": v for k, v in r2d2(
                    recorded, args.r2d2_rows, args.r2d2_large, args.seconds,
                    Path(directory)).items()})
            args.r2d2_large = 0  # the large table once
        if args.torchrl_python and args.only in (None, "torchrl"):
            sizes = [("atari", args.torchrl_rows)] + ([("small", args.index_rows)]
                                                     if args.index_rows else [])
            for kind, rows in sizes:
                results.update({f"torchrl.{kind}.{k}": v for k, v in versus_torchrl(
                    args.torchrl_python, kind, rows, args.seconds, 1).items()})
        for key, value in results.items():
            runs.setdefault(key, []).append(value)
        gc.collect()
    medians = {key: statistics.median(values) for key, values in runs.items()}
    for key, value in medians.items():
        print(f"  {key:40} {value:>16,.2f}")
    if "apex.plain_bytes_per_row" in medians:
        m = medians
        print(f"apex memory: {m['apex.plain_bytes_per_row'] / m['apex.apex_bytes_per_row']:.1f}x "
              f"less than plain, {m['apex.plain_lz4_bytes_per_row'] / m['apex.apex_bytes_per_row']:.1f}x "
              f"less than plain + lz4; sample+update "
              f"{m['apex.apex_sample_update_per_s'] / m['apex.plain_sample_update_per_s']:.2f}x plain")
    for kind in ("atari", "small"):
        m = medians
        if f"torchrl.{kind}.torchrl_sample_per_s" in m:
            speedup = (m[f"torchrl.{kind}.ours_sample_per_s"]
                       / m[f"torchrl.{kind}.torchrl_sample_per_s"])
            print(f"r2d2 vs torchrl ({kind}): {speedup:.1f}x torchrl's sample(64 x 80) rate")
    if "r2d2.plain_sample_per_s" in medians:
        m = medians
        print(f"r2d2 sample 64x80: {m['r2d2.r2d2_sample_per_s'] / m['r2d2.plain_sample_per_s']:.2f}x "
              f"plain (time ratio {m['r2d2.plain_sample_per_s'] / m['r2d2.r2d2_sample_per_s']:.2f})")


if __name__ == "__main__":
    main()
