"""Where an insert's time goes with the write-ahead log on: group commit seen from inside a server.

Starts one real server (``wal = true``, ``--sync``), whose process loads a
``sitecustomize`` that wraps the log's methods to count (nothing of the log
is changed): groups written (one ``writev`` each) and ``fdatasync`` calls,
records and bytes per sync, seconds in ``writev`` and in ``fdatasync``, and
how long callers wait in :meth:`WriteAheadLog.wait` (from the record queued
to the caller woken). ``--writers`` client threads insert ``--batch`` rows of
``--kind`` for ``--seconds``; then the server writes its counts to a JSON
file and the script prints them with the insert rate. With ``--py-spy PATH``,
py-spy records the server meanwhile (``--spy-out``: its flame graph, SVG;
``--spy-format raw``: collapsed stacks).

    .venv/bin/python benchmarks/wal_profile.py [--kind atari] [--sync fsync] [--seconds 10]
        [--py-spy /tmp/pyspy/bin/py-spy --spy-out /tmp/wal.svg]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from wal import KINDS, rows  # benchmarks/ is on sys.path: this script's directory

_SHIM = r'''import atexit, json, os, signal, threading, time
out = os.environ.get("WAL_PROFILE_OUT")
if out:
    from replay_server.checkpoint.wal import log as _log
    W = _log.WriteAheadLog
    stats = dict(groups=0, records=0, bytes=0, writev_s=0.0, sync_s=0.0, waits=0, wait_s=0.0,
                 wait_max_s=0.0, lead_s=0.0, syncs=0)
    queued = {}
    lock = threading.Lock()
    _append, _wait, _flush = W.append, W.wait, W._flush
    lead_name = "_write_group" if hasattr(W, "_write_group") else "_lead"  # the tree before
    _lead = getattr(W, lead_name)
    _writev, _fdatasync = os.writev, os.fdatasync

    def writev(fd, buffers):
        t = time.perf_counter(); n = _writev(fd, buffers)
        stats["writev_s"] += time.perf_counter() - t; return n

    def fdatasync(fd):
        t = time.perf_counter(); _fdatasync(fd)
        stats["sync_s"] += time.perf_counter() - t; stats["syncs"] += 1

    os.writev, os.fdatasync = writev, fdatasync

    def append(self, buffers):
        number = _append(self, buffers)
        queued[number] = time.perf_counter()
        return number

    def wait(self, number):
        try:
            return _wait(self, number)
        finally:
            t = queued.pop(number, None)
            if t is not None:
                d = time.perf_counter() - t
                with lock:
                    stats["waits"] += 1; stats["wait_s"] += d
                    stats["wait_max_s"] = max(stats["wait_max_s"], d)

    def flush(self, buffers):
        if buffers:
            stats["bytes"] += sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
        return _flush(self, buffers)

    def lead(self):
        stats["records"] += len(self._pending); stats["groups"] += 1
        t = time.perf_counter()
        try:
            return _lead(self)
        finally:
            stats["lead_s"] += time.perf_counter() - t

    W.append, W.wait, W._flush = append, wait, flush
    setattr(W, lead_name, lead)
    def dump(*_):
        with open(out, "w") as f:
            json.dump(stats, f)
    signal.signal(signal.SIGUSR1, dump)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="atari", choices=sorted(KINDS))
    parser.add_argument("--sync", default="fsync", choices=["fsync", "os", "off"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--py-spy", default=None, help="py-spy's path: record the server")
    parser.add_argument("--spy-out", default="/tmp/wal_profile.svg")
    parser.add_argument("--spy-format", default="flamegraph")
    parser.add_argument("--spy-flag", action="append", default=[],
                        help="more py-spy flags (e.g. --spy-flag=--gil: only the GIL's holder)")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    from replay_client import ReplayClient

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        (root / "shim").mkdir()
        (root / "shim" / "sitecustomize.py").write_text(_SHIM)
        log_lines = "" if args.sync == "off" else \
            f'wal = true\nwal_sync = "{args.sync}"\nwal_max_mb = 65536\n'
        (root / "config.toml").write_text(
            f'[server]\ncheckpoint_dir = "{root / "ckpt"}"\ncheckpoint_interval_s = 0\n'
            f'{log_lines}[[tables]]\nname = "bench"\ncapacity = {args.capacity}\n'
            f'sampler = "uniform"\n{KINDS[args.kind][1]}')
        env = dict(os.environ, WAL_PROFILE_OUT=str(root / "stats.json"),
                   PYTHONPATH=os.pathsep.join([str(root / "shim"), os.environ.get("PYTHONPATH", "")]))
        port_file = root / "port"
        server = subprocess.Popen(
            [sys.executable, "-m", "replay_server.app.cli", "serve", "--config",
             str(root / "config.toml"), "--address", "127.0.0.1:0", "--port-file", str(port_file)],
            stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        deadline = time.monotonic() + 300
        while not (port_file.exists() and port_file.read_text().strip()):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "server.log").read_text()[-2000:])
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        clients = [ReplayClient(address, timeout=600) for _ in range(args.writers)]
        block = rows(args.kind, args.batch, seed=1)
        for client in clients:
            client.insert("bench", block)  # warm
        stop, counts = threading.Event(), [0] * args.writers

        def writer(k: int) -> None:
            while not stop.is_set():
                clients[k].insert("bench", block)
                counts[k] += 1

        spy = None
        if args.py_spy:
            spy = subprocess.Popen([args.py_spy, "record", "-p", str(server.pid), "-o",
                                    args.spy_out, "-f", args.spy_format, "-r", "200",
                                    "-d", str(int(args.seconds)), "--threads", *args.spy_flag],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.sync != "off":
            server.send_signal(signal.SIGUSR1)  # counts before the measured turn
            time.sleep(0.5)
        before = json.loads((root / "stats.json").read_text()) if args.sync != "off" else {}
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(args.writers)]
        load = os.getloadavg()
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        time.sleep(args.seconds)
        stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        if args.sync != "off":
            server.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        after = json.loads((root / "stats.json").read_text()) if args.sync != "off" else {}
        if spy is not None:
            spy.wait(120)
        for client in clients:
            client.close()
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    calls = sum(counts)
    d = {k: after[k] - before[k] for k in after if k != "wait_max_s"}
    result: dict = {"kind": args.kind, "sync": args.sync, "load": [round(x, 1) for x in load],
                    "calls_s": round(calls / elapsed, 1), "rows_s": round(calls * args.batch / elapsed)}
    if d:
        groups, syncs = max(d["groups"], 1), max(d["syncs"], 1)
        result.update(
            groups_s=round(d["groups"] / elapsed, 1),
            syncs_s=round(d["syncs"] / elapsed, 1),
            records_per_group=round(d["records"] / groups, 2),
            records_per_sync=round(d["records"] / syncs, 2),
            bytes_per_sync=round(d["bytes"] / syncs),
            log_mb_s=round(d["bytes"] / elapsed / 1e6, 1),
            writev_ms_per_group=round(1e3 * d["writev_s"] / groups, 2),
            group_ms=round(1e3 * d["lead_s"] / groups, 2),
            fdatasync_ms=round(1e3 * d["sync_s"] / syncs, 2),
            wait_ms_per_call=round(1e3 * d["wait_s"] / max(d["waits"], 1), 2),
            share_of_time_syncing=round(d["sync_s"] / elapsed, 2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
