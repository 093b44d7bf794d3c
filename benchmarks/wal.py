"""Insert throughput with the write-ahead log off, at wal_sync = "os" and at "fsync" (issue 29).

One run, side by side, on one disk: a real server per setting (loopback,
separate process), ``--writers`` client threads inserting ``--batch`` rows
per call for ``--seconds``, for small rows (17 float32) and Atari rows
(84x84x4 uint8, lz4-compressed in the table). Beside them, the disk's own
sequential synced write rate, measured as ``dd bs=1M count=N conv=fdatasync``
does it (1 MiB writes, one fdatasync at the end), and its rate of small
synced writes (one 64 KiB write + fdatasync at a time: what a log of lone
calls would pay). Prints one JSON object; the issue's bound: at least 0.7x
of "off", or 80% of the disk's synced sequential rate, whichever is lower.

    .venv/bin/python benchmarks/wal.py [--seconds 5] [--writers 4] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from sides import replay_server  # benchmarks/ is on sys.path: this script's directory
from wal_restore import log_replay

KINDS = {"small": ({"obs": ("float32", (17,))}, ""),
         "atari": ({"frame": ("uint8", (84, 84, 4))}, 'compress_keys = ["frame"]\n')}


def rows(kind: str, n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    layout, _ = KINDS[kind]
    out = {}
    for key, (dtype, shape) in layout.items():
        if dtype == "uint8":  # screens: mostly flat regions, as Atari frames are (lz4 gains)
            data = np.zeros((n, *shape), dtype=np.uint8)
            data[:, 20:40, 10:70] = rng.integers(0, 255, (n, 20, 60, shape[-1]), dtype=np.uint8)
        else:
            data = rng.random((n, *shape)).astype(dtype)
        out[key] = data
    return out


def disk_rates(directory: Path, mib: int = 256) -> dict:
    """dd bs=1M count=mib conv=fdatasync, and 64 KiB write+fdatasync pairs, in MB/s."""
    path = directory / "dd.bin"
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(mib):
            os.write(fd, block)
        os.fdatasync(fd)
        sequential = mib * (1 << 20) / (time.perf_counter() - start) / 1e6
        small, count = block[: 64 << 10], 0
        start = time.perf_counter()
        while time.perf_counter() - start < 2.0:
            os.write(fd, small)
            os.fdatasync(fd)
            count += 1
        synced_small = count * len(small) / (time.perf_counter() - start) / 1e6
    finally:
        os.close(fd)
        path.unlink()
    return {"dd_fdatasync_mb_s": round(sequential, 1),
            "write_64k_fdatasync_mb_s": round(synced_small, 1),
            "fdatasyncs_per_s": round(count / 2.0, 1)}


def insert_rate(root: Path, kind: str, wal: str, args: argparse.Namespace) -> dict:
    from replay_client import ReplayClient

    _, table_extra = KINDS[kind]
    log_lines = "" if wal == "off" else f'wal = true\nwal_sync = "{wal}"\nwal_max_mb = 65536\n'
    config = (f'[server]\ncheckpoint_dir = "{root / "ckpt"}"\ncheckpoint_interval_s = 0\n'
              f'{log_lines}[[tables]]\nname = "bench"\ncapacity = {args.capacity}\n'
              f'sampler = "uniform"\n{table_extra}')
    block = rows(kind, args.batch, seed=1)
    nbytes = sum(v.nbytes for v in block.values())
    counts = [0] * args.writers
    stop = threading.Event()
    with replay_server(root, config) as address:
        def writer(k: int) -> None:
            client = ReplayClient(address, timeout=600)
            while not stop.is_set():
                client.insert("bench", block)
                counts[k] += 1
            client.close()

        warm = ReplayClient(address)
        for _ in range(3):
            warm.insert("bench", block)
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(args.writers)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        time.sleep(args.seconds)
        stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        log_bytes = sum(p.stat().st_size for p in (root / "ckpt").glob("wal-*.log"))
    calls = sum(counts)
    logged_rows = (calls + 3) * args.batch
    return {"rows_s": round(calls * args.batch / elapsed), "calls_s": round(calls / elapsed, 1),
            "mb_s": round(calls * nbytes / elapsed / 1e6, 1),
            "log_mb": round(log_bytes / 1e6, 1),
            "log_bytes_per_row": round(log_bytes / logged_rows, 1) if log_bytes else 0,
            "row_bytes": nbytes // args.batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="rows per insert call")
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--dir", default=None, help="where the logs go (a tmp dir there)")
    parser.add_argument("--replay-mb", type=float, default=1000.0,
                        help="log replayed on restart (0: skip; benchmarks/wal_restore.py)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="row kinds, comma-separated")
    parser.add_argument("--levels", default="off,os,fsync",
                        help="log settings, comma-separated (ratios need off)")
    parser.add_argument("--no-disk", action="store_true", help="skip the disk's own rates")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        result: dict = {"args": vars(args),
                        "disk": {} if args.no_disk else disk_rates(root)}
        levels = args.levels.split(",")
        for kind in args.kinds.split(","):
            result[kind] = {}
            for wal in levels:
                run = root / f"{kind}-{wal}"
                run.mkdir()
                result[kind][wal] = insert_rate(run, kind, wal, args)
                print(f"{kind} wal={wal}: {result[kind][wal]}", file=sys.stderr)
            if "off" not in levels:
                continue
            off = result[kind]["off"]["mb_s"]
            for wal in levels:
                if wal != "off":
                    result[kind][f"{wal}_vs_off"] = round(result[kind][wal]["mb_s"] / off, 2)
        if args.replay_mb > 0:
            (root / "replay").mkdir()
            result["replay"] = log_replay(root / "replay", args.replay_mb, lz4=False)
            print(f"replay: {result['replay']}", file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
