"""What Prometheus metrics cost the service: the service benchmark with metrics off and on.

    python benchmarks/metrics_overhead.py --reverb-python .venv-reverb/bin/python

For each row kind and operation of ``benchmarks/service.py`` (insert, sample,
priority updates), runs our server with metrics off, then on while a scraper
reads ``/metrics`` once a second (15 times Prometheus' usual rate), alternating
``--rounds`` times, so that drift on a shared machine hits both alike. Prints
the median rate of each API for both and the ratio on / off; with
``--reverb-python``, Reverb's rate in the same run as the anchor.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", help="python of Reverb's virtualenv")
    parser.add_argument("--seconds", type=float, default=w.SECONDS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(w.ROW_KINDS))
    parser.add_argument("--cases", default="insert,sample,update")
    args = parser.parse_args()

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
                            records = service._ours(kind, case, args.seconds, config)
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
