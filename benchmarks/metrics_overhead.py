"""What Prometheus metrics cost the service: the service benchmark with metrics off and on.

    python benchmarks/metrics_overhead.py --reverb-python .venv-reverb/bin/python
    python benchmarks/metrics_overhead.py --cpu

For each row kind and operation of ``benchmarks/service.py`` (insert, sample,
priority updates), runs our server with metrics off, then on while a scraper
reads ``/metrics`` once a second (15 times Prometheus' usual rate), alternating
``--rounds`` times, so that drift on a shared machine hits both alike. Prints
the median rate of each API for both and the ratio on / off; with
``--reverb-python``, Reverb's rate in the same run as the anchor.

``--cpu`` measures instead what a shared machine's noise hides in rates: the
server process's CPU time (all its threads, scrapes included) per call, for a
fixed number of small calls (insert of 256 small rows, sample of 256,
update of 1,024 ids), metrics off and on. ``--interceptor`` times the
interceptor alone, in this process: a unary call through it against the bare
handler.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service  # noqa: E402
import service_workload as w  # noqa: E402

SCRAPE_INTERVAL_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scraper:
    """Reads ``url`` every ``SCRAPE_INTERVAL_S`` until stopped; counts the scrapes that answered."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_INTERVAL_S):
            try:
                with urllib.request.urlopen(self.url, timeout=10) as response:
                    response.read()
                self.scrapes += 1
            except OSError:
                pass  # the server is starting or stopping


def _rates(records: list[dict]) -> dict[str, float]:
    return {r["api"]: r.get("rows_per_s", r.get("ids_per_s")) for r in records}


CPU_CALLS = 2000
CPU_CONFIG = ('[server]\nworkers = 2\n[[tables]]\nname = "small"\ncapacity = 1_000_000\n'
              'sampler = "prioritized"\n')


def _cpu(rounds: int) -> None:
    """Server CPU microseconds per call, metrics off and on (see the module docstring)."""
    import tempfile

    import psutil
    import torch

    from replay_client import ReplayClient
    from sides import replay_server

    torch.set_num_threads(1)
    rows = {"obs": torch.randn(256, 17)}
    cost: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    for round_ in range(rounds):
        for variant in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            port = _free_port()
            config = CPU_CONFIG if variant == "off" else CPU_CONFIG.replace(
                "[server]\n", f'[server]\nmetrics_address = "127.0.0.1:{port}"\n', 1)
            with tempfile.TemporaryDirectory() as tmp, replay_server(Path(tmp), config) as address:
                [server] = [c for c in psutil.Process().children() if "serve" in c.cmdline()]
                client = ReplayClient(address, timeout=60)
                client.insert("small", {"obs": torch.randn(100_000, 17)})
                ids = client.sample("small", 1024).ids
                calls = {
                    "insert (256 small rows)": lambda: client.insert("small", rows),
                    "sample (batch 256)": lambda: client.sample("small", 256),
                    "update_priorities (1024 ids)": lambda: client.update_priorities(
                        "small", ids, torch.rand(1024) + 0.1),
                }
                scraper = Scraper(f"http://127.0.0.1:{port}/metrics") if variant == "on" else None
                if scraper is not None:
                    scraper.__enter__()
                try:
                    for name, call in calls.items():
                        for _ in range(100):
                            call()
                        before = sum(server.cpu_times()[:2])
                        for _ in range(CPU_CALLS):
                            call()
                        used = sum(server.cpu_times()[:2]) - before
                        cost[variant].setdefault(name, []).append(used / CPU_CALLS * 1e6)
                finally:
                    if scraper is not None:
                        scraper.__exit__()
            print(f"round {round_ + 1} metrics {variant}: "
                  + ", ".join(f"{k} {v[-1]:.0f} us" for k, v in cost[variant].items()),
                  file=sys.stderr)
    print(f"server CPU time per call, medians of {rounds} alternating rounds of {CPU_CALLS} "
          f"calls each\n")
    print("| call | metrics off | metrics on, scraped every 1 s | extra per call | on / off |")
    print("|---|---:|---:|---:|---:|")
    for name in cost["off"]:
        off, on = statistics.median(cost["off"][name]), statistics.median(cost["on"][name])
        print(f"| {name} | {off:.0f} us | {on:.0f} us | {on - off:+.0f} us | {on / off:.3f} |")


def _interceptor(calls: int = 100_000) -> None:
    """Microseconds the RPC metrics add to one unary call (in process, no network)."""
    import asyncio
    import time

    import grpc

    from replay_server.service.rpc_metrics import RpcMetrics

    class Context:
        def code(self) -> None:
            return None

    class Details:
        method = "/replay.v1.ReplayService/Sample"
        invocation_metadata = ()

    async def behaviour(request: bytes, context: Context) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(behaviour)

    async def continuation(details: Details) -> grpc.RpcMethodHandler:
        return handler

    async def run() -> tuple[float, float]:
        metrics, context, request = RpcMetrics(), Context(), b"x" * 64
        start = time.perf_counter()
        for _ in range(calls):
            await continuation(Details)
            await behaviour(request, context)
        bare = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(calls):
            wrapped = await metrics.intercept_service(continuation, Details)
            await wrapped.unary_unary(request, context)
        return bare / calls, (time.perf_counter() - start) / calls

    times = [asyncio.run(run()) for _ in range(5)]
    bare = statistics.median(t[0] for t in times) * 1e6
    measured = statistics.median(t[1] for t in times) * 1e6
    print(f"a unary call through the RPC metrics: {measured:.2f} us, bare handler {bare:.2f} us: "
          f"{measured - bare:.2f} us per call (median of 5 x {calls:,} calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", help="python of Reverb's virtualenv")
    parser.add_argument("--seconds", type=float, default=w.SECONDS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(w.ROW_KINDS))
    parser.add_argument("--cases", default="insert,sample,update")
    parser.add_argument("--cpu", action="store_true",
                        help="measure the server's CPU time per call instead of rates")
    parser.add_argument("--interceptor", action="store_true",
                        help="time the RPC metrics interceptor alone, in process")
    args = parser.parse_args()
    if args.interceptor:
        _interceptor()
        return
    if args.cpu:
        _cpu(args.rounds)
        return

    lines = ["| rows | operation | metrics off | metrics on, scraped every 1 s | on / off "
             "| Reverb 0.14.0 | on / Reverb |", "|---|---|---:|---:|---:|---:|---:|"]
    for kind in args.kinds.split(","):
        for case in args.cases.split(","):
            runs: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
            scrapes = 0
            for round_ in range(args.rounds):
                for variant in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                    print(f"{kind} {case} round {round_ + 1} metrics {variant}", file=sys.stderr)
                    if variant == "off":
                        records = service._ours(kind, case, args.seconds)
                    else:
                        port = _free_port()
                        config = service._CONFIG.replace(
                            "[server]\n", f'[server]\nmetrics_address = "127.0.0.1:{port}"\n', 1)
                        with Scraper(f"http://127.0.0.1:{port}/metrics") as scraper:
                            records = service._ours(kind, case, args.seconds, config=config)
                        scrapes += scraper.scrapes
                    for api, rate in _rates(records).items():
                        runs[variant].setdefault(api, []).append(rate)
            reverb = (service._reverb(args.reverb_python, kind, case, args.seconds)
                      if args.reverb_python else None)
            metric = "ids_per_s" if case == "update" else "rows_per_s"
            unit = "ids/s" if case == "update" else "rows/s"
            theirs = (reverb or {}).get(metric)
            for api in runs["off"]:
                off = statistics.median(runs["off"][api])
                on = statistics.median(runs["on"][api])
                anchor = (f"{theirs:,.0f} {unit} | {on / theirs:.2f}x" if theirs
                          else "n/a | n/a")
                lines.append(f"| {kind} | {case}: {api} | {off:,.0f} {unit} | {on:,.0f} {unit} "
                             f"| {on / off:.3f} | {anchor} |")
            print(f"  scrapes answered while measuring: {scrapes}", file=sys.stderr)
    print(f"medians of {args.rounds} alternating rounds of {args.seconds:g} s each\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
