"""How fast a server with the write-ahead log comes back after ``kill -9`` (issue 29).

Two figures, each through real server processes on one disk:

* ``log``: a checkpoint of one insert, then ``--log-mb`` of inserts logged
  after it (Atari rows, 84x84x4 uint8, 64 a call; ``--lz4`` stores them
  compressed, and the log holds them so), ``kill -9``, restart: the replay's
  rate (GB of log a second, from the server's own log line) and the time from
  the restart's spawn to SERVING (the port file; the spawn itself, importing
  torch, is in it).
* ``table``: the checkpoint_stall benchmark's table sizes (``--table-gb``,
  2 GB: 70,829 Atari rows or 24.7 million small rows, its row layouts), filled
  and checkpointed, then ``--after`` of the table inserted again (logged),
  ``kill -9``, restart: the checkpoint's load, the log's replay and the time
  to SERVING, each from the server's log lines.

    .venv/bin/python benchmarks/wal_restore.py [--log-mb 1000] [--table-gb 2] [--dir /tmp]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from checkpoint_stall import layout, make_rows, row_bytes  # benchmarks/ is on sys.path

_REPLAYED = re.compile(r"replayed the write-ahead log: (\d+) change.*?\(([\d.]+) MB in ([\d.]+) s")
_RESTORED = re.compile(r"restored \d+ table\(s\) from .*?\((\d+) rows, ([\d.]+) MB in ([\d.]+) s\)")


def frames(n: int, seed: int) -> dict:
    """Atari-like screens: flat but for a 20x60 patch of noise (what lz4 gains on frames)."""
    rng = np.random.default_rng(seed)
    data = np.zeros((n, 84, 84, 4), dtype=np.uint8)
    data[:, 20:40, 10:70] = rng.integers(0, 255, (n, 20, 60, 4), dtype=np.uint8)
    return {"frame": data}


def serve(root: Path, config: Path, name: str) -> tuple[subprocess.Popen, str, float]:
    """Spawn a server; returns it, its address and the seconds from spawn to SERVING."""
    port_file = root / f"{name}.port"
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "replay_server.app.cli", "serve", "--config", str(config),
         "--address", "127.0.0.1:0", "--port-file", str(port_file)],
        stdout=open(root / f"{name}.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    while not (port_file.exists() and port_file.read_text().strip()):
        if process.poll() is not None or time.perf_counter() - start > 1800:
            raise RuntimeError((root / f"{name}.log").read_text()[-2000:])
        time.sleep(0.01)
    return process, f"127.0.0.1:{port_file.read_text().strip()}", time.perf_counter() - start


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def _config(root: Path, capacity: int, sampler: str, extra: str) -> Path:
    config = root / "replay.toml"
    config.write_text(f'[server]\ncheckpoint_dir = "{root / "ckpt"}"\ncheckpoint_interval_s = 0\n'
                      f'wal = true\nwal_sync = "os"\nwal_max_mb = 65536\n[[tables]]\n'
                      f'name = "bench"\ncapacity = {capacity}\nsampler = "{sampler}"\n{extra}')
    return config


def _restart(root: Path, config: Path) -> dict:
    """kill -9 happened: restart, read the figures off the server's log, stop it."""
    log_bytes = sum(p.stat().st_size for p in (root / "ckpt").glob("wal-*.log"))
    process, _, serving_s = serve(root, config, "second")
    _kill(process)
    text = (root / "second.log").read_text()
    replayed = _REPLAYED.search(text)
    assert replayed is not None, "the restart replayed nothing"
    mb, seconds = float(replayed.group(2)), float(replayed.group(3))
    out = {"log_mb": round(log_bytes / 1e6, 1), "changes": int(replayed.group(1)),
           "replay_s": seconds, "replay_gb_s": round(mb / 1e3 / max(seconds, 1e-9), 2),
           "kill_to_serving_s": round(serving_s, 2)}
    restored = _RESTORED.search(text)
    if restored is not None:
        out.update(checkpoint_rows=int(restored.group(1)),
                   checkpoint_mb=float(restored.group(2)),
                   checkpoint_load_s=float(restored.group(3)))
    return out


def log_replay(root: Path, log_mb: float, lz4: bool) -> dict:
    """A checkpoint of one insert, ``log_mb`` of log after it, kill -9, restart."""
    from replay_client import ReplayClient

    block = frames(64, seed=2)
    per_call = block["frame"].nbytes
    if lz4:  # the log holds the compressed blocks: about 5 KB a row with these frames
        per_call = 64 * 5_100
    calls = max(1, int(log_mb * 1e6) // per_call)
    config = _config(root, (calls + 1) * 64, "uniform",
                     'compress_keys = ["frame"]\n' if lz4 else "")
    process, address, _ = serve(root, config, "first")
    client = ReplayClient(address, timeout=600)
    client.insert("bench", block)
    client.checkpoint()
    for _ in range(calls):
        client.insert("bench", block)
    client.close()
    _kill(process)
    return {"rows": "atari lz4" if lz4 else "atari", **_restart(root, config)}


def table_restore(root: Path, kind: str, table_gb: float, after: float) -> dict:
    """checkpoint_stall's table (``table_gb`` of ``kind`` rows), full and checkpointed, then
    ``after`` of it inserted again into the log; kill -9, restart."""
    from replay_client import ReplayClient

    capacity = int(table_gb * 1e9) // row_bytes(kind)
    per_call = max(32, (8 << 20) // row_bytes(kind))  # inserts of about 8 MB
    config = _config(root, capacity, "prioritized", "")
    process, address, _ = serve(root, config, "first")
    client = ReplayClient(address, timeout=600)
    block = make_rows(kind, per_call)
    for _ in range(-(-capacity // per_call)):
        client.insert("bench", block)
    client.checkpoint()
    for _ in range(max(1, int(capacity * after) // per_call)):
        client.insert("bench", block)
    client.close()
    _kill(process)
    return {"rows": kind, "table_gb": round(capacity * row_bytes(kind) / 1e9, 2),
            "table_rows": capacity, "row_bytes": row_bytes(kind),
            "layout": ", ".join(f"{k} {d}{list(s)}" for k, (d, s) in layout(kind).items()),
            **_restart(root, config)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-mb", type=float, default=1000.0, help="0: skip the log figure")
    parser.add_argument("--lz4", action="store_true", help="the log figure's rows compressed")
    parser.add_argument("--table-gb", type=float, default=2.0, help="0: skip the table figures")
    parser.add_argument("--tables", default="atari,small", help="checkpoint_stall row kinds")
    parser.add_argument("--after", type=float, default=0.25,
                        help="share of the table inserted after its checkpoint (logged)")
    parser.add_argument("--dir", default=None, help="where the runs go (a tmp dir there)")
    args = parser.parse_args()
    result: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        if args.log_mb > 0:
            (root / "log").mkdir()
            result["log"] = log_replay(root / "log", args.log_mb, args.lz4)
            print(f"log: {result['log']}", file=sys.stderr)
        for kind in args.tables.split(",") if args.table_gb > 0 else []:
            (root / kind).mkdir()
            result[kind] = table_restore(root / kind, kind, args.table_gb, args.after)
            print(f"{kind}: {result[kind]}", file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
