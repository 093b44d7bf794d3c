"""Insert throughput with the write-ahead log, every setting interleaved in short turns.

benchmarks/wal.py measures each setting once, one after another: on a shared,
busy machine the load moves between them and the ratios swing (0.4x to 1.0x
from run to run). Here every server runs at once (log off, ``"os"``,
``"fsync"``; optionally each also with the ``replay_server`` of another source
tree, ``--base``), and ``--writers`` client threads insert into one server at a
time for ``--seconds``, server after server, for ``--rounds`` rounds: each
setting sees the same moments of load. Prints one JSON object: rows/s per
setting (sum over rounds), each level against "off" of its own tree, and,
with ``--base``, each setting of this tree against the base's; each ratio
also as the median over rounds of that round's ratio (``..._median``: one
turn that a burst of load hit moves it less than the sums). ``--ops``:
what the clients do in their turn: insert (the default), sample, or read
a stream (``--sample-batch`` rows a batch, from ``--fill`` rows inserted
first): the read path, which the log should not slow; or update the
priorities of ``--sample-batch`` rows a call, waiting for each answer (a
prioritized table; rows/s then counts ids).

``--base DIR``: a tree holding ``server/replay_server`` (e.g. ``git archive
COMMIT server | tar -x -C DIR``); its servers import that package instead of
the installed one (through a ``sitecustomize`` this script writes).

Inserts also measure, in turns of their own between the servers' (same
rounds, same load), the disk's own synced sequential write rate where the
logs are: ``dd conv=fdatasync`` in Python (sequential writes of one insert's
log record, the size the log writes per call, measured from the ``"fsync"``
server's log after the warm-up; one ``fdatasync`` at the end of the turn),
and the log's own pattern at best (writes of ``--writers`` records, each
followed by ``fdatasync``: one group of every writer). The issue's bound for
``"fsync"`` is the lower of 0.7x of "off" and 80% of the ``dd`` rate in rows
(bytes over the log's bytes per row); the result says which applied.

    .venv/bin/python benchmarks/wal_interleaved.py [--kinds small] [--rounds 10]
        [--seconds 1] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from replay_server.checkpoint.wal.records import SEGMENT_HEADER_BYTES
from wal import KINDS, rows  # benchmarks/ is on sys.path: this script's directory

_SHIM = '''import os, sys
base = os.environ.get("WAL_BENCH_BASE")
if base:
    for name, module in list(sys.modules.items()):
        if name.startswith("__editable__") and hasattr(module, "MAPPING"):
            module.MAPPING.pop("replay_server", None)
    sys.path.insert(0, os.path.join(base, "server"))
'''


class Server:
    """One replay-server process of one setting, and its writers' clients."""

    def __init__(self, root: Path, name: str, kind: str, level: str, base: str | None,
                 args: argparse.Namespace, sampler: str = "uniform") -> None:
        from replay_client import ReplayClient

        self.name, self.level, self.base = name, level, base
        root.mkdir(parents=True)
        log_lines = "" if level == "off" else \
            f'wal = true\nwal_sync = "{level}"\nwal_max_mb = 65536\n'
        config = root / "config.toml"
        config.write_text(
            f'[server]\ncheckpoint_dir = "{root / "ckpt"}"\ncheckpoint_interval_s = 0\n'
            f'{log_lines}[[tables]]\nname = "bench"\ncapacity = {args.capacity}\n'
            f'sampler = "{sampler}"\n{KINDS[kind][1]}')
        env = dict(os.environ)
        if base is not None:
            env.update(WAL_BENCH_BASE=base,
                       PYTHONPATH=os.pathsep.join([args.shim, env.get("PYTHONPATH", "")]))
        port_file = root / "port"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "replay_server.app.cli", "serve", "--config", str(config),
             "--address", "127.0.0.1:0", "--port-file", str(port_file)],
            stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        deadline = time.monotonic() + 300
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "server.log").read_text()[-2000:])
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        self.clients = [ReplayClient(address, timeout=600) for _ in range(args.writers)]
        self.log_dir = root / "ckpt"
        self.calls = 0
        self.turns: list[float] = []  # calls/s of each turn after the warm-up
        self.inserts = 0  # insert calls answered since the start (warm-up included)
        self.ids: list[Any] = []  # ids of the rows inserted to fill the table
        self.seconds = 0.0

    def turn(self, op: str, block: dict, seconds: float, batch: int) -> None:
        """``op`` from every client at once for ``seconds``: inserts of ``block``, samples or
        a stream's batches of ``batch`` rows; count the calls answered (the batches)."""
        stop = threading.Event()
        counts = [0] * len(self.clients)

        def writer(k: int) -> None:
            client = self.clients[k]
            if op == "stream":
                with client.stream("bench", batch, prefetch=4) as stream:
                    for _ in stream:
                        counts[k] += 1
                        if stop.is_set():
                            return
            ids = torch.cat(self.ids) if op == "update" else None
            while not stop.is_set():
                if op == "insert":
                    client.insert("bench", block)
                elif op == "update":
                    start = (counts[k] * batch) % max(1, len(ids) - batch)
                    client.update_priorities("bench", ids[start:start + batch],
                                             torch.rand(batch) + 0.1, wait=True)
                else:
                    client.sample("bench", batch)
                counts[k] += 1

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(len(self.clients))]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        self.calls += sum(counts)
        self.turns.append(sum(counts) / elapsed)
        self.inserts += sum(counts) if op == "insert" else 0

    def log_bytes_per_call(self) -> float:
        """The log's bytes per insert call so far (segment headers left out)."""
        segments = list(self.log_dir.glob("wal-*.log"))
        nbytes = sum(p.stat().st_size - SEGMENT_HEADER_BYTES for p in segments)
        return nbytes / max(self.inserts, 1)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Disk:
    """The disk's own synced sequential write rate, in turns like a server's: writes of
    ``write_bytes`` into one file, ``fdatasync`` after each (``per_write``) or once at the
    end of the turn (``dd conv=fdatasync``); ``calls`` counts bytes."""

    def __init__(self, root: Path, name: str, per_write: bool) -> None:
        self.name, self.per_write = name, per_write
        self.path = root / f"{name.replace('/', '-')}.bin"
        self.write_bytes = 0
        self.calls = 0
        self.seconds = 0.0

    def turn(self, op: str, block: dict, seconds: float, batch: int) -> None:
        data = os.urandom(self.write_bytes)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = 0
        start = time.perf_counter()
        try:
            while time.perf_counter() - start < seconds:
                written += os.write(fd, data)
                if self.per_write:
                    os.fdatasync(fd)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self.seconds += time.perf_counter() - start
        self.calls += written
        self.path.unlink()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _bound(result: dict, rate: dict, bytes_per_row: float, disks: list[Disk]) -> None:
    """The issue's bound for "fsync" (see the module docstring), and whether it was met."""
    disk = {d.name: d.calls / d.seconds for d in disks}
    rows_by_dd = disk["disk/dd"] / bytes_per_row
    bounds = {"0.7x of off": 0.7 * rate["this/off"], "80% of dd": 0.8 * rows_by_dd}
    applied = min(bounds, key=bounds.__getitem__)
    result["disk"] = {"write_bytes": disks[0].write_bytes,
                      "dd_fdatasync_mb_s": round(disk["disk/dd"] / 1e6, 1),
                      "synced_groups_mb_s": round(disk["disk/synced"] / 1e6, 1),
                      "log_bytes_per_row": round(bytes_per_row, 1)}
    for level in ("os", "fsync"):
        if f"this/{level}" in rate:
            log_mb_s = rate[f"this/{level}"] * bytes_per_row / 1e6
            result["disk"][f"{level}_log_mb_s"] = round(log_mb_s, 1)
    result["bound"] = {"applied": applied, "rows_s": round(bounds[applied]),
                       "other": {k: round(v) for k, v in bounds.items() if k != applied},
                       "fsync_rows_s": rate["this/fsync"],
                       "met": rate["this/fsync"] >= bounds[applied]}


def measure(root: Path, kind: str, op: str, args: argparse.Namespace) -> dict:
    trees = [("this", None)] + ([("base", str(Path(args.base).resolve()))] if args.base else [])
    sampler = "prioritized" if op == "update" else "uniform"
    servers = [Server(root / f"{kind}-{op}-{tree}-{level}", f"{tree}/{level}", kind, level, base,
                      args, sampler) for tree, base in trees for level in args.levels.split(",")]
    block = rows(kind, args.batch, seed=1)
    per_call = args.batch if op == "insert" else args.sample_batch
    try:
        for server in servers:  # warm: the schema, the first segment; rows to sample
            if op != "insert":
                for _ in range(max(1, args.fill // args.batch)):
                    server.ids.append(server.clients[0].insert("bench", block))
            server.turn(op, block, 0.2, args.sample_batch)
            server.calls, server.seconds, server.turns = 0, 0.0, []
        disks: list[Disk] = []
        synced = next((s for s in servers if s.name == "this/fsync"), None)
        if op == "insert" and synced is not None and "this/off" in [s.name for s in servers]:
            record = synced.log_bytes_per_call()
            disks = [Disk(root, "disk/dd", per_write=False), Disk(root, "disk/synced", True)]
            disks[0].write_bytes = max(1, round(record))
            disks[1].write_bytes = max(1, round(record * args.writers))
            servers = [*servers, *disks]  # type: ignore[list-item]
        for round_ in range(args.rounds):
            order = servers[round_ % len(servers):] + servers[:round_ % len(servers)]
            for server in order:
                server.turn(op, block, args.seconds, args.sample_batch)
        if disks:  # before the servers stop: a stop's checkpoint truncates the log
            assert synced is not None
            record = synced.log_bytes_per_call()
    finally:
        for server in servers:
            server.close()
    rate = {s.name: round(s.calls * per_call / s.seconds) for s in servers
            if not isinstance(s, Disk)}
    result: dict = {"rows_s": rate}
    by_name = {s.name: s.turns for s in servers if not isinstance(s, Disk)}

    def median_ratio(a: str, b: str) -> float:  # over rounds: each round's a against its b
        return round(statistics.median(x / y for x, y in zip(by_name[a], by_name[b]) if y), 2)

    if disks:
        _bound(result, rate, record / args.batch, disks)
    for tree, _ in trees:
        off = rate.get(f"{tree}/off")
        for level in args.levels.split(","):
            if off and level != "off":
                result[f"{tree}/{level}_vs_off"] = round(rate[f"{tree}/{level}"] / off, 2)
                result[f"{tree}/{level}_vs_off_median"] = median_ratio(f"{tree}/{level}",
                                                                      f"{tree}/off")
    if args.base:
        for level in args.levels.split(","):
            result[f"{level}_this_vs_base"] = round(rate[f"this/{level}"] / rate[f"base/{level}"], 2)
            result[f"{level}_this_vs_base_median"] = median_ratio(f"this/{level}", f"base/{level}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="small", help="row kinds, comma-separated")
    parser.add_argument("--ops", default="insert",
                        help="insert, sample, stream, update (comma-separated): what the "
                             "clients do")
    parser.add_argument("--sample-batch", type=int, default=256, help="rows per sample/batch")
    parser.add_argument("--fill", type=int, default=20_000, help="rows inserted before sampling")
    parser.add_argument("--levels", default="off,os,fsync")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0, help="one server's turn")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="rows per insert call")
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--base", default=None, help="a tree with server/replay_server")
    parser.add_argument("--dir", default=None, help="where the logs go (a tmp dir there)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        args.shim = str(root / "shim")
        os.makedirs(args.shim)
        (Path(args.shim) / "sitecustomize.py").write_text(_SHIM)
        load = os.getloadavg()
        result: dict = {"args": {k: v for k, v in vars(args).items() if k != "shim"},
                        "load_before": [round(x, 1) for x in load]}
        for kind in args.kinds.split(","):
            for op in args.ops.split(","):
                result[f"{kind}/{op}"] = measure(root, kind, op, args)
                print(f"{kind}/{op}: {result[f'{kind}/{op}']}", file=sys.stderr)
        result["load_after"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
