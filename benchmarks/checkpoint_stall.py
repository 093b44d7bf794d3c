"""How long does a checkpoint stall a sampler? (issue 5: target <= 100 ms for a 2 GB table)

    python benchmarks/checkpoint_stall.py                    # engine, in-process
    python benchmarks/checkpoint_stall.py --mode service     # real server + client over loopback

Fills a prioritized table with about ``--gb`` GB of Atari-like rows
(84x84x4 uint8 frames) or of small rows (17 float32), then times every call
of a sampler thread (batches of 32), first for ``--baseline-s`` seconds with
no checkpoint, then while a checkpoint of the table is written; optionally an
inserter thread (32 rows per call) runs throughout. Prints, per phase, the
longest sample call, p99 and p50, and the checkpoint's write time and GB/s.

Engine mode also records the checkpoint's own longest lock holds (at the
instant, per piece read, per copy aside), which separate what the design
costs from the machine's noise, and times a restore of the checkpoint.

For comparison (engine mode) it also times what the other designs would
stall: copying the whole table under its lock (what ``state_dict`` did
before snapshots), and ``fork()`` of the process holding the table (the
Redis BGSAVE way: the stall is the fork itself, copying page tables).

Prints one JSON object at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from sides import replay_server  # benchmarks/ is on sys.path: this script's directory

BATCH = 32
INSERT_ROWS = 32


def layout(kind: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    if kind == "atari":
        return {"obs": ("uint8", (84, 84, 4)), "action": ("int64", ()),
                "reward": ("float32", ()), "done": ("bool", ())}
    return {"obs": ("float32", (17,)), "action": ("int64", ()), "reward": ("float32", ()),
            "done": ("bool", ())}


def row_bytes(kind: str) -> int:
    return sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in layout(kind).values())


def make_rows(kind: str, n: int, seed: int = 0):
    import torch

    rng = np.random.default_rng(seed)
    out = {}
    for key, (dtype, shape) in layout(kind).items():
        if dtype == "uint8":
            array = rng.integers(0, 255, size=(n, *shape), dtype=np.uint8)
        elif dtype == "bool":
            array = rng.random((n, *shape)) < 0.01
        elif dtype == "int64":
            array = rng.integers(0, 18, size=(n, *shape), dtype=np.int64)
        else:
            array = rng.standard_normal((n, *shape)).astype(dtype)
        out[key] = torch.from_numpy(array)
    return out


class Timer:
    """Latencies of calls made by one thread, with start times."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.seconds: list[float] = []

    def timed(self, fn):  # noqa: ANN001
        start = time.perf_counter()
        fn()
        self.starts.append(start)
        self.seconds.append(time.perf_counter() - start)

    def window(self, t0: float, t1: float) -> dict:
        s = np.array(self.starts)
        d = np.array(self.seconds)
        # a call counts for the window if it overlapped it
        mask = (s + d >= t0) & (s <= t1)
        d = d[mask]
        if d.size == 0:
            return {"calls": 0}
        return {"calls": int(d.size), "max_ms": float(d.max() * 1e3),
                "p99_ms": float(np.percentile(d, 99) * 1e3),
                "p50_ms": float(np.percentile(d, 50) * 1e3)}


def run_threads(sample, insert, stop: threading.Event, with_inserter: bool):
    sampler, inserter = Timer(), Timer()
    errors: list[BaseException] = []

    def loop(timer: Timer, fn) -> None:  # noqa: ANN001
        try:
            while not stop.is_set():
                timer.timed(fn)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(sampler, sample), daemon=True)]
    if with_inserter:
        threads.append(threading.Thread(target=loop, args=(inserter, insert), daemon=True))
    for thread in threads:
        thread.start()
    return sampler, inserter, threads, errors


def measure(sample, insert, checkpoint, with_inserter: bool, baseline_s: float):  # noqa: ANN001, ANN201
    """Sample (and insert) in threads: ``baseline_s`` without a checkpoint, then during one.

    Returns the case's name, the sampler's (and inserter's) figures in both
    windows plus how long the checkpoint call took, and what it returned.
    """
    stop = threading.Event()
    sampler, inserter, threads, errors = run_threads(sample, insert, stop, with_inserter)
    t0 = time.perf_counter()
    time.sleep(baseline_s)
    t1 = time.perf_counter()
    written = checkpoint()
    t2 = time.perf_counter()
    time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    name = "sampler_and_inserter" if with_inserter else "sampler_only"
    figures = {
        "baseline": sampler.window(t0, t1),
        "during_checkpoint": sampler.window(t1, t2),
        "inserts_during_checkpoint": inserter.window(t1, t2) if with_inserter else None,
        "checkpoint_call_s": t2 - t1,
    }
    return name, figures, written


class _Holds(dict):
    def clear(self) -> None:
        for value in self.values():
            value.clear()


def instrument_lock_holds() -> dict[str, list[float]]:
    """Record how long the checkpoint holds the table's lock: at the snapshot instant, for
    each piece the reader copies, and for each copy an insert makes aside (engine mode)."""
    from replay_server.engine.snapshot import Arena, StorageSnapshot

    holds = _Holds(instant=[], reader_piece=[], insert_copy_aside=[])
    copy, before_write, active = StorageSnapshot._copy, StorageSnapshot.before_write, Arena.active

    def timed_copy(self, start, end, out=None):  # noqa: ANN001
        t = time.perf_counter()
        try:
            return copy(self, start, end, out)
        finally:
            if not getattr(self, "_in_write", False):
                holds["reader_piece"].append(time.perf_counter() - t)

    def timed_before_write(self, first_slot, count):  # noqa: ANN001
        t = time.perf_counter()
        self._in_write = True
        try:
            return before_write(self, first_slot, count)
        finally:
            self._in_write = False
            holds["insert_copy_aside"].append(time.perf_counter() - t)

    @contextmanager
    def timed_instant(self):  # noqa: ANN001 - the arena is active exactly while the lock is held
        t = time.perf_counter()
        with active(self):
            yield self
        holds["instant"].append(time.perf_counter() - t)

    StorageSnapshot._copy = timed_copy
    StorageSnapshot.before_write = timed_before_write
    Arena.active = timed_instant
    return holds


def engine(args: argparse.Namespace, root: Path) -> dict:
    import torch

    from replay_server import Table, TableConfig, TableSet
    from replay_server.checkpoint import CheckpointDirectory, load_checkpoint, write_checkpoint

    torch.set_num_threads(1)
    holds = instrument_lock_holds()
    rb = row_bytes(args.rows)
    capacity = int(args.gb * 1e9) // rb
    table = Table(TableConfig(name="bench", capacity=capacity, sampler="prioritized", seed=0))
    block = make_rows(args.rows, 1000)
    t = time.perf_counter()
    for _ in range(-(-capacity // 1000)):
        table.insert(block)
    fill_s = time.perf_counter() - t
    small = make_rows(args.rows, INSERT_ROWS, seed=1)
    gc.freeze()  # as the server does once started
    directory = CheckpointDirectory(root / "ckpt")
    directory.open()
    result: dict = {"mode": "engine", "rows": args.rows, "capacity": capacity,
                    "table_gb": capacity * rb / 1e9, "fill_s": fill_s}
    for with_inserter in (False, True):

        def checkpoint():  # noqa: ANN202
            holds.clear()
            return write_checkpoint([table], directory, keep_latest=1, server_version="bench")

        name, figures, written = measure(
            lambda: table.sample(BATCH), lambda: table.insert(small), checkpoint,
            with_inserter, args.baseline_s)
        result[name] = {
            **figures,
            "checkpoint_s": written.seconds, "checkpoint_gb": written.nbytes / 1e9,
            "checkpoint_gb_per_s": written.gb_per_s,
            # the checkpoint's own lock holds: the instant, the reader's pieces, copies aside
            "lock_holds_ms": {k: max(v, default=0.0) * 1e3 for k, v in holds.items()},
        }
    # Restore speed: load the last checkpoint into a fresh table (its pages were dropped
    # from the page cache as they were written, so this reads the disk).
    fresh = TableSet([table.config])
    t = time.perf_counter()
    load_checkpoint(written.path, fresh)
    result["restore_s"] = time.perf_counter() - t
    result["restore_gb_per_s"] = written.nbytes / 1e9 / result["restore_s"]
    assert fresh["bench"].size == table.size
    del fresh
    # What the alternatives would stall, for comparison.
    storage = table._storage
    assert storage is not None
    with table._lock:
        t = time.perf_counter()
        copies = {k: v.copy() for k, v in storage.views.items()}
        result["copy_under_lock_ms"] = (time.perf_counter() - t) * 1e3
    del copies
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    result["fork_ms"] = (time.perf_counter() - t) * 1e3
    os.waitpid(pid, 0)
    directory.close()
    return result


def service(args: argparse.Namespace, root: Path) -> dict:
    import torch

    from replay_client import ReplayClient

    torch.set_num_threads(1)
    rb = row_bytes(args.rows)
    capacity = int(args.gb * 1e9) // rb
    config = (
        f'[server]\ncheckpoint_dir = "{root / "ckpt"}"\ncheckpoint_interval_s = 0\n'
        f'keep_latest = 1\nworkers = 2\n'
        f'[[tables]]\nname = "bench"\ncapacity = {capacity}\nsampler = "prioritized"\n')
    with replay_server(root, config, log_path=root / "server.log") as address:
        client = ReplayClient(address, timeout=600)
        per_call = max(1, (16 << 20) // rb)
        block = make_rows(args.rows, per_call)
        t = time.perf_counter()
        for _ in range(-(-capacity // per_call)):
            client.insert("bench", block)
        fill_s = time.perf_counter() - t
        small = make_rows(args.rows, INSERT_ROWS, seed=1)
        result: dict = {"mode": "service", "rows": args.rows, "capacity": capacity,
                        "table_gb": capacity * rb / 1e9, "fill_s": fill_s}
        sample_client, insert_client = ReplayClient(address), ReplayClient(address)
        for with_inserter in (False, True):
            name, figures, _ = measure(
                lambda: sample_client.sample("bench", BATCH),
                lambda: insert_client.insert("bench", small), client.checkpoint,
                with_inserter, args.baseline_s)
            result[name] = figures
    for line in (root / "server.log").read_text().splitlines():
        if "checkpoint (" in line:
            print("  server:", line.split(": ", 1)[-1], file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("engine", "service"), default="engine")
    parser.add_argument("--rows", choices=("atari", "small"), default="atari")
    parser.add_argument("--gb", type=float, default=2.0, help="table size (default 2 GB)")
    parser.add_argument("--baseline-s", type=float, default=5.0)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))
    try:
        result = (engine if args.mode == "engine" else service)(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python " \
                        f"{platform.python_version()}"
    for phase in ("sampler_only", "sampler_and_inserter"):
        r = result[phase]
        base, during = r["baseline"], r["during_checkpoint"]
        print(f"{phase}: sample max {during['max_ms']:.1f} ms, p99 {during['p99_ms']:.2f} ms, "
              f"p50 {during['p50_ms']:.2f} ms during the checkpoint ({during['calls']} calls); "
              f"baseline max {base['max_ms']:.1f} ms, p99 {base['p99_ms']:.2f} ms",
              file=sys.stderr)
        if r.get("inserts_during_checkpoint"):
            ins = r["inserts_during_checkpoint"]
            print(f"  inserts during the checkpoint: max {ins['max_ms']:.1f} ms, p99 "
                  f"{ins['p99_ms']:.2f} ms ({ins['calls']} calls)", file=sys.stderr)
        if "checkpoint_s" in r:
            print(f"  checkpoint: {r['checkpoint_gb']:.2f} GB in {r['checkpoint_s']:.2f} s "
                  f"({r['checkpoint_gb_per_s']:.2f} GB/s); longest lock holds: "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in r["lock_holds_ms"].items()),
                  file=sys.stderr)
    if "restore_s" in result:
        print(f"restore: {result['restore_s']:.2f} s ({result['restore_gb_per_s']:.2f} GB/s)",
              file=sys.stderr)
    if "fork_ms" in result:
        print(f"alternatives: copy under the lock {result['copy_under_lock_ms']:.0f} ms, "
              f"fork() {result['fork_ms']:.1f} ms", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
