"""Stream shapes benchmark: one server's stream against a sharded stream, and across a slow link.

    python benchmarks/stream_shapes.py [--kinds atari,small] [--seconds 5] [--rounds 2]
        [--paths "plain, gRPC|sharded x1"] [--in-process-proxy]

The learner is this process; the servers run in their own processes on
127.0.0.1. For each row kind (Atari frames, about 28 KB, or 17 floats) it
measures batches of 256 delivered to host memory per second, side by side
and alternating (``--rounds``: each path measured that many times, in turn,
so that drift on a shared machine hits every path alike; the median run is
kept):

* ``plain``: ``ReplayClient(address).stream(...)``;
* ``sharded x1``: ``ReplayClient([address]).stream(...)`` (the sharded stream
  over that one server: its per-shard SampleStream and its merge);
* ``sharded x2`` / ``sharded x3``: the sharded stream over two or three
  local servers holding the same number of rows each (``sharded x2 /
  plain``: what splitting one server's table over two shards costs a
  learner on this host, issue 28: each shard's rows are merged, copied once,
  into the learner's batch where one server's shared-memory batch is a view);
* ``plain 5 ms`` / ``plain 5 ms, prefetch 2``: the plain stream through the
  test proxy adding 5 ms each way (``tests/tools/proxy.py``), with the window
  left to the stream (it widens) and fixed at 2; ``plain proxy 0 ms``: the
  same proxy adding no delay, so that the 5 ms ratio can also be read
  without the proxy's own cost. Each proxy runs in a process of its own
  (:func:`proxy_process`), as a network between hosts would, so its relaying
  does not take the learner's interpreter (on this 2-core machine it still
  takes a core's share from the learner and the servers).

Each over gRPC (``shared_memory=False``) and, for ``plain``, ``sharded x1``
and ``sharded x2``, through the same-host shared-memory ring; ``prefetch`` is
left to the stream except where named. Prints batches/s, GB/s and the ratios
the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import service_workload as w  # noqa: E402
from sides import replay_server  # noqa: E402

PREFILL = {"atari": 6_000, "small": 60_000}
WARMUP_BATCHES = 5


def _config(kind: str, shard: int) -> str:
    return (f"[server]\nshard = {shard}\nmax_message_mb = 64\nworkers = 2\n"
            f'[[tables]]\nname = "{kind}"\ncapacity = {w.CAPACITY[kind]}\n'
            f'sampler = "prioritized"\nalpha = {w.ALPHA}\nbeta = {w.BETA}\n')


def _fill(client, kind: str, rows: int) -> None:  # type: ignore[no-untyped-def]
    import torch

    step = 1_000 if kind == "atari" else 10_000
    for first in range(0, rows, step):
        batch = w.make_rows(kind, first, step)
        client.insert(kind, {key: torch.from_numpy(value) for key, value in batch.items()})


PLAIN_IN_PROCESS = "plain 5 ms, gRPC, proxy in the learner's process"

_PROXY = """
import sys
sys.path.insert(0, sys.argv[1])
import tests.tools.proxy as tool
tool.CHUNK_BYTES = int(sys.argv[4])  # relayed per read: fewer, larger reads cost less
tool.QUEUE_CHUNKS = max(2, (16 << 20) // tool.CHUNK_BYTES)  # the tool's 16 MiB bound each way
with tool.LinkProxy(sys.argv[2], delay_s=float(sys.argv[3])) as proxy:
    print(proxy.address, flush=True)
    sys.stdin.read()  # until the benchmark closes the pipe
"""


@contextmanager
def proxy_process(target: str, delay_s: float, chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """The test proxy (``tests/tools/proxy.py``) to ``target`` in a process of its own, adding
    ``delay_s`` each way and relaying up to ``chunk_bytes`` per read (the tool's 64 KiB costs
    a Python loop turn per 64 KiB: at 0.7 GB/s that alone takes a core); yields its address.
    Ends it when the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", _PROXY, str(HERE.parent), target, str(delay_s),
                             str(chunk_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"the proxy process ended (rc {proc.wait(10)})")
        yield address
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _drive(stream, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    with stream:
        for _ in range(WARMUP_BATCHES):
            next(stream)
        before, batches = stream.stats.bytes, 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            next(stream)
            batches += 1
        elapsed = time.perf_counter() - start
        return {"batches_per_s": batches / elapsed,
                "gb_per_s": (stream.stats.bytes - before) / elapsed / 1e9,
                "transport": stream.transport, "window": stream.window,
                "notes": stream.stats.notes}


def measure(kind: str, seconds: float, rounds: int, only: list[str] | None = None,
            in_process_proxy: bool = False, proxy_chunk: int = 1 << 20) -> dict[str, dict]:
    import torch

    from replay_client import ReplayClient

    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        addresses = []
        for shard in range(3):
            folder = Path(tmp) / f"s{shard}"
            folder.mkdir()
            addresses.append(stack.enter_context(replay_server(folder, _config(kind, shard))))
        for address in addresses:  # the same rows on each
            _fill(ReplayClient(address, timeout=120), kind, PREFILL[kind])
        one = ReplayClient(addresses[0], timeout=120)
        trio = ReplayClient(addresses, timeout=120, seed=1)
        duo = ReplayClient(addresses[:2], timeout=120, seed=1)
        far = ReplayClient(stack.enter_context(proxy_process(addresses[0], 0.005, proxy_chunk)),
                           timeout=120)
        near = ReplayClient(stack.enter_context(proxy_process(addresses[0], 0.0, proxy_chunk)),
                            timeout=120)
        single = ReplayClient([addresses[0]], timeout=120, seed=1)
        clients = [one, trio, far, near, single, duo]
        if in_process_proxy:  # the earlier set-up: the proxy in a thread of the learner's process
            from tests.tools.proxy import LinkProxy

            inner = stack.enter_context(LinkProxy(addresses[0], delay_s=0.005))
            clients.append(ReplayClient(inner.address, timeout=120))
        paths = {
            "plain, gRPC": lambda: one.stream(kind, w.SAMPLE_BATCH, shared_memory=False),
            "sharded x1, gRPC": lambda: single.stream(kind, w.SAMPLE_BATCH,
                                                      shared_memory=False),
            "plain, shared memory": lambda: one.stream(kind, w.SAMPLE_BATCH,
                                                       batches_per_message=1),
            "sharded x1, shared memory": lambda: single.stream(kind, w.SAMPLE_BATCH,
                                                               batches_per_message=1),
            "sharded x2, gRPC": lambda: duo.stream(kind, w.SAMPLE_BATCH, shared_memory=False),
            "sharded x2, shared memory": lambda: duo.stream(kind, w.SAMPLE_BATCH,
                                                            batches_per_message=1),
            "sharded x3, gRPC": lambda: trio.stream(kind, w.SAMPLE_BATCH, shared_memory=False),
            "plain proxy 0 ms, gRPC": lambda: near.stream(kind, w.SAMPLE_BATCH,
                                                          shared_memory=False),
            "plain 5 ms, gRPC": lambda: far.stream(kind, w.SAMPLE_BATCH, shared_memory=False),
            "plain 5 ms, gRPC, prefetch 2": lambda: far.stream(
                kind, w.SAMPLE_BATCH, shared_memory=False, prefetch=2),
        }
        if in_process_proxy:
            paths[PLAIN_IN_PROCESS] = lambda: clients[-1].stream(
                kind, w.SAMPLE_BATCH, shared_memory=False)
        if only:
            paths = {name: fn for name, fn in paths.items() if any(o in name for o in only)}
        for _ in range(rounds):
            for name, open_stream in paths.items():
                runs.setdefault(name, []).append(_drive(open_stream(), seconds))
                print(f"  {kind} {name}: {runs[name][-1]['batches_per_s']:.1f} batches/s",
                      file=sys.stderr)
        for client in clients:
            client.close()
    return {name: sorted(r, key=lambda x: x["batches_per_s"])[len(r) // 2]
            for name, r in runs.items()} | {"_all": runs}  # type: ignore[operator]


def table(results: dict[str, dict[str, dict]], rounds: int) -> str:
    import torch

    head = (f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}; batches of "
            f"{w.SAMPLE_BATCH} to host memory; median of {rounds} alternating runs\n\n")
    lines = ["| rows | path | batches/s | GB/s | window | runs (batches/s) |",
             "|---|---|---:|---:|---:|---|"]
    ratios = []
    for kind, paths in results.items():
        for name, r in paths.items():
            if name == "_all":
                continue
            each = ", ".join(f"{x['batches_per_s']:.0f}" for x in paths["_all"][name])
            lines.append(f"| {kind} | {name} | {r['batches_per_s']:,.1f} | {r['gb_per_s']:.2f}"
                         f" | {r['window']} | {each} |")

        def rate(name: str) -> float:
            return paths[name]["batches_per_s"] if name in paths else math.nan

        ratios += [
            f"| {kind} | sharded x1 / plain, gRPC | {rate('sharded x1, gRPC') / rate('plain, gRPC'):.2f}x |",
            f"| {kind} | sharded x1 / plain, shared memory | "
            f"{rate('sharded x1, shared memory') / rate('plain, shared memory'):.2f}x |",
            f"| {kind} | sharded x2 / plain, gRPC | "
            f"{rate('sharded x2, gRPC') / rate('plain, gRPC'):.2f}x |",
            f"| {kind} | sharded x2 / plain, shared memory | "
            f"{rate('sharded x2, shared memory') / rate('plain, shared memory'):.2f}x |",
            f"| {kind} | sharded x3 / sharded x1, gRPC | "
            f"{rate('sharded x3, gRPC') / rate('sharded x1, gRPC'):.2f}x |",
            f"| {kind} | plain 5 ms / plain loopback, gRPC | "
            f"{rate('plain 5 ms, gRPC') / rate('plain, gRPC'):.0%} |",
            f"| {kind} | plain 5 ms / plain proxy 0 ms, gRPC (the proxy's own cost taken out) | "
            f"{rate('plain 5 ms, gRPC') / rate('plain proxy 0 ms, gRPC'):.0%} |",
            f"| {kind} | plain 5 ms, prefetch 2 / plain loopback, gRPC | "
            f"{rate('plain 5 ms, gRPC, prefetch 2') / rate('plain, gRPC'):.0%} |",
            f"| {kind} | plain 5 ms, proxy in the learner's process / plain loopback, gRPC | "
            f"{rate(PLAIN_IN_PROCESS) / rate('plain, gRPC'):.0%} |",
        ]
        ratios = [r for r in ratios if "nan" not in r]
    return head + "\n".join(lines) + "\n\n| rows | ratio | value |\n|---|---|---:|\n" + \
        "\n".join(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(w.ROW_KINDS))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paths", help="measure only the paths whose names contain one of "
                                            "these |-separated texts (e.g. 'plain, gRPC|5 ms')")
    parser.add_argument("--in-process-proxy", action="store_true",
                        help="also measure 5 ms through the proxy in a thread of this process "
                             "(the earlier set-up, for comparison)")
    parser.add_argument("--proxy-chunk-kb", type=int, default=1024,
                        help="bytes the proxy process relays per read, in KiB (the test tool's "
                             "own default is 64)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    only = args.paths.split("|") if args.paths else None
    results = {kind: measure(kind, args.seconds, args.rounds, only, args.in_process_proxy,
                             args.proxy_chunk_kb * 1024)
               for kind in args.kinds.split(",")}
    print(table(results, args.rounds))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
