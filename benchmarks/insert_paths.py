"""Where one large insert's time goes: a chunked gRPC call against the call stream's region.

One ``replay-server serve`` and this process as its client, on one host. Two
clients insert the same rows: one as a client on another host would (large
inserts chunked: ``REPLAY_SHARED_MEMORY=0`` when its insert stream is made),
one through the shared-memory region of its call stream. For each, per call:
the wall time, this process's CPU and the server's CPU (from ``/proc``), for
an ``insert`` of ``--rows`` Atari rows (84x84x4 uint8) and for a ``Writer``'s
``--rows`` steps and its flush. The paths alternate within every round, so
a machine's swings hit both alike.

    python benchmarks/insert_paths.py [--rows 256] [--calls 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sides import replay_server  # noqa: E402

CONFIG = '[server]\nworkers = 2\n[[tables]]\nname = "t"\ncapacity = 20000\nsampler = "uniform"\n'


def children_cpu_s() -> float:
    """CPU seconds of this process's children (the server), user and system."""
    return sum(t.user + t.system for t in (
        p.cpu_times() for p in psutil.Process().children()))


def per_call(call: Callable[[], object], calls: int) -> dict[str, float]:
    """Milliseconds per call: wall, this process's CPU, the server's CPU."""
    wall, cpu, server = time.monotonic(), time.process_time(), children_cpu_s()
    for _ in range(calls):
        call()
    return {"wall_ms": (time.monotonic() - wall) / calls * 1e3,
            "client_cpu_ms": (time.process_time() - cpu) / calls * 1e3,
            "server_cpu_ms": (children_cpu_s() - server) / calls * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from replay_client import ReplayClient

    rows = {"obs": torch.randint(0, 255, (args.rows, 84, 84, 4), dtype=torch.uint8),
            "action": torch.zeros(args.rows, dtype=torch.int64),
            "reward": torch.zeros(args.rows)}
    step = {key: value[0] for key, value in rows.items()}
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        address = stack.enter_context(replay_server(Path(tmp), CONFIG))
        clients = {}
        for path, shared in (("chunked", "0"), ("region", "1")):
            os.environ["REPLAY_SHARED_MEMORY"] = shared  # read when the insert stream is made
            client = stack.enter_context(ReplayClient(address))
            client.insert("t", rows)
            clients[path] = client
        os.environ.pop("REPLAY_SHARED_MEMORY")
        writers = {path: client.writer("t", batch_rows=args.rows)
                   for path, client in clients.items()}

        def writer_steps(path: str) -> None:
            writer = writers[path]
            for _ in range(args.rows):
                writer.append(step)
            writer.flush()

        for path, client in clients.items():  # warm: the table's pages, both paths
            for _ in range(20):
                client.insert("t", rows)
        for round_ in range(args.rounds):
            for path, client in clients.items():
                for case, call in (("insert", lambda c=client: c.insert("t", rows)),
                                   ("writer", lambda p=path: writer_steps(p))):
                    figures = per_call(call, args.calls)
                    result = {"round": round_ + 1, "path": path, "case": case, **{
                        key: round(value, 2) for key, value in figures.items()}}
                    results.append(result)
                    print(json.dumps(result), flush=True)
        for writer in writers.values():
            writer.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
