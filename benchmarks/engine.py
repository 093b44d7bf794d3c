"""Engine benchmark: replay-server's Table against TorchRL's in-process buffers.

    python benchmarks/engine.py --torchrl-python .venv-torchrl/bin/python

(or ``make bench-engine``, which also builds TorchRL's virtualenv). Each
measurement runs in a fresh process, one at a time, ours then TorchRL's, so
they never compete for the 2 cores or for memory; the same rows come from
``benchmarks/workload.py`` on both sides. Prints one markdown table with
ratios (TorchRL time / our time: above 1 means we are faster). ``--repeat N``
measures every case N times, the sides alternating, and reports each side's
median run with the spread of the per-round ratios in brackets.

``--base DIR`` compares this tree's engine with another checkout's instead of
TorchRL (``git archive COMMIT | tar -x -C DIR``, then ``python proto/generate.py`` in
it): each side runs its own tree's ``engine.py`` with that tree's packages first on
``PYTHONPATH`` and the same Python; with ``--repeat N`` the sides alternate which
goes first, and the ratio is base / this tree (above 1: this tree is faster). The
before/after check of a refactor::

    python benchmarks/engine.py --base /tmp/before --repeat 5 --max-rows 1000000

``--side ours --case CASE ...`` runs a single measurement of our engine and
prints it as one JSON line; the orchestrator calls itself that way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload as w  # noqa: E402
from sides import run_side  # noqa: E402


# --------------------------------------------------------------------- our side


def _fill(table, rows: int, columns: tuple[str, ...]) -> None:
    for start in range(0, rows, w.FILL_CHUNK):
        chunk = w.make_rows(start, min(w.FILL_CHUNK, rows - start))
        table.insert({k: chunk[k] for k in columns})


def _timed_ops(op, seconds: float, max_ops: int, warmup: int = 3,
               cpu: list[float] | None = None) -> list[float]:
    """Wall times of ``op``; the calling thread's CPU time per op goes to ``cpu`` if given."""
    for i in range(warmup):
        op(-1 - i)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < max_ops and (len(times) < 5 or time.perf_counter() < deadline):
        start, start_cpu = time.perf_counter(), time.thread_time()
        op(len(times))
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.thread_time() - start_cpu)
    return times


def _ours(case: str, rows: int, batch: int, seconds: float, threads: int) -> dict:
    import torch

    from replay_server import Table, TableConfig

    torch.set_num_threads(threads)
    all_columns = ("obs", "reward", "done", "episode")
    if case == "prioritized":
        table = Table(TableConfig(name="b", capacity=rows, sampler="prioritized",
                                  alpha=w.ALPHA, beta=w.BETA, seed=0))
        _fill(table, rows, all_columns)

        def op(i: int) -> None:
            sample = table.sample(batch)
            table.update_priorities(sample.ids, w.new_priorities(batch, seed=i))

        cpu: list[float] = []
        times = _timed_ops(op, seconds, 200, cpu=cpu)
        # Thread CPU time moves less than wall time when other jobs share the cores.
        return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
                "cpu_median_s": statistics.median(cpu), "ops": len(times),
                "threads": torch.get_num_threads()}
    if case == "slice":
        table = Table(TableConfig(name="b", capacity=rows, sampler="slice",
                                  slice_len=w.SLICE_LEN, seed=0))
        _fill(table, rows, all_columns)
        next_row = [rows]
        insert_times: list[float] = []

        def op(i: int) -> None:
            chunk = w.make_rows(next_row[0], w.SLICE_INSERT_ROWS)
            next_row[0] += w.SLICE_INSERT_ROWS
            start = time.perf_counter()
            table.insert(chunk)
            insert_times.append(time.perf_counter() - start)
            table_start = time.perf_counter()
            table.sample(w.SLICE_BATCH)
            sample_times.append(time.perf_counter() - table_start)

        sample_times: list[float] = []
        _timed_ops(op, seconds, 100)
        return {"median_s": statistics.median(sample_times[3:]),
                "insert_median_s": statistics.median(insert_times[3:]),
                "ops": len(sample_times) - 3}
    if case == "insert":
        table = Table(TableConfig(name="b", capacity=1_000_000, sampler="uniform"))
        chunks = [w.make_rows(i * batch, batch) for i in range(max(3, 2_000_000 // batch))]
        table.insert(chunks[0])
        start = time.perf_counter()
        for chunk in chunks[1:]:
            table.insert(chunk)
        elapsed = time.perf_counter() - start
        return {"rows_per_s": (len(chunks) - 1) * batch / elapsed}
    if case == "memory":
        before = w.resident_bytes(trim=True)
        table = Table(TableConfig(name="b", capacity=rows, sampler="prioritized",
                                  alpha=w.ALPHA, beta=w.BETA))
        _fill(table, rows, ("obs", "reward", "done"))
        untrimmed = w.resident_bytes(trim=False) - before
        grown = w.resident_bytes(trim=True) - before
        raw = rows * w.ROW_BYTES_NO_EPISODE
        return {"rss_bytes": grown, "raw_bytes": raw, "ratio": grown / raw,
                "ratio_untrimmed": untrimmed / raw}
    raise SystemExit(f"unknown case {case!r}")


# ----------------------------------------------------------------- orchestrator

PLAN = (
    [("prioritized", r, b) for r in w.PRIORITIZED_ROWS for b in w.PRIORITIZED_BATCHES]
    + [("slice", r, w.SLICE_BATCH) for r in w.SLICE_ROWS]
    + [("insert", 1_000_000, b) for b in w.INSERT_ROWS_PER_CALL]
    + [("memory", w.MEMORY_ROWS, 0)]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["ours"], help="run one measurement (internal)")
    parser.add_argument("--case")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--torchrl-python", help="python of TorchRL's virtualenv")
    parser.add_argument("--base", type=Path,
                        help="another checkout's engine in TorchRL's place (before/after)")
    parser.add_argument("--only", nargs="*", help="cases to run (default: all)")
    parser.add_argument("--max-rows", type=int, default=None, help="skip larger tables")
    parser.add_argument("--json", type=Path, help="also write all results here")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads on both sides (default 1: with a thread "
                             "per core, a core busy with other work made TorchRL's sample of "
                             "256 rows 7.3 ms instead of 0.6 ms, intra-op threads waiting on "
                             "each other)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each case this many times, the sides alternating; "
                             "report each side's median run and the spread of the ratio")
    args = parser.parse_args()

    if args.side == "ours":
        result = _ours(args.case, args.rows, args.batch, args.seconds, args.threads)
        print(json.dumps({"impl": "replay-server", "case": args.case, "rows": args.rows,
                          "batch": args.batch, **result}))
        return

    results = []
    for case, rows, batch in PLAN:
        if args.only and case not in args.only:
            continue
        if args.max_rows and rows > args.max_rows:
            continue
        seconds = "10" if case == "slice" else "5"
        common = ["--case", case, "--rows", str(rows), "--batch", str(batch), "--seconds", seconds]
        print(f"{case} rows={rows:,} batch={batch:,}", file=sys.stderr)
        rounds = []
        for round_ in range(args.repeat):
            sides = [lambda: run_side([*_tree(HERE.parent), str(Path(__file__)), "--side", "ours",
                                       *common, "--threads", str(args.threads)], 1800),
                     lambda: _other(args, common)]
            if args.base and round_ % 2:  # before/after: each goes first every other round
                sides.reverse()
            first, second = (side() for side in sides)
            ours, theirs = (second, first) if args.base and round_ % 2 else (first, second)
            rounds.append((ours, theirs))
            print(f"  ours={ours}\n  {'base' if args.base else 'torchrl'}={theirs}",
                  file=sys.stderr)
        results.append({"case": case, "rows": rows, "batch": batch,
                        "ours": _median_run([r[0] for r in rounds], case),
                        "torchrl": _median_run([r[1] for r in rounds], case),
                        "ratios": [_ratio(a, b, case) for a, b in rounds],
                        "pairs": rounds})

    print(_ab_table(results) if args.base else _table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _tree(root: Path) -> list[str]:
    """The command prefix that runs Python with ``root``'s packages first on its path."""
    packages = os.pathsep.join(str(root / p) for p in ("client", "feed", "proto", "server"))
    return ["env", f"PYTHONPATH={packages}", sys.executable]


def _other(args: argparse.Namespace, common: list[str]) -> dict | None:
    """The compared side's measurement: ``--base``'s engine, or TorchRL's (if given)."""
    if args.base:
        return run_side([*_tree(args.base), str(args.base / "benchmarks" / "engine.py"),
                         "--side", "ours", *common], 1800)
    if args.torchrl_python:
        return run_side([args.torchrl_python, str(HERE / "torchrl_engine.py"), *common,
                         "--threads", str(args.threads)], 1800)
    return None


def _ab_table(results: list[dict]) -> str:
    """Before/after (``--base``): each case's median figure per side, and per round how
    many times faster this tree is (above 1: faster; by thread CPU time too, where
    measured: it moves less than wall time when other work shares the cores)."""
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f} at the end\n",
             "| case | rows | batch | figure | base (median) | this tree (median) | "
             "this tree faster by, per round (median) | by CPU time |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    for r in results:
        case = r["case"]
        name = {"insert": "rows/s", "memory": "RSS / raw bytes"}.get(case, "s per op")
        cpu = [b["cpu_median_s"] / a["cpu_median_s"] for a, b in r.get("pairs", [])
               if a and b and a.get("cpu_median_s") and b.get("cpu_median_s")]
        lines.append(f"| {case} | {r['rows']:,} | {r['batch']:,} | {name} | "
                     f"{_metric(r['torchrl'], case) or float('nan'):.4g} | "
                     f"{_metric(r['ours'], case) or float('nan'):.4g} | "
                     f"{_spread([x for x in r['ratios'] if x is not None])} | {_spread(cpu)} |")
    return "\n".join(lines)


def _spread(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return ", ".join(f"{x:.2f}" for x in ratios) + f" ({statistics.median(ratios):.2f}x)"


def _metric(record: dict | None, case: str) -> float | None:
    """The figure a case is judged by (lower is better except for inserts)."""
    if not record:
        return None
    return record.get({"insert": "rows_per_s", "memory": "ratio"}.get(case, "median_s"))


def _median_run(records: list[dict | None], case: str) -> dict | None:
    """The run with the median figure (the lower median of an even count)."""
    measured = sorted((r for r in records if _metric(r, case) is not None),
                      key=lambda r: _metric(r, case))
    return measured[(len(measured) - 1) // 2] if measured else None


def _ratio(ours: dict | None, theirs: dict | None, case: str) -> float | None:
    """TorchRL / ours (above 1: ours is better), per round."""
    a, b = _metric(ours, case), _metric(theirs, case)
    if not a or not b:
        return None
    return a / b if case == "insert" else b / a


def _table(results: list[dict]) -> str:
    import torch

    from report import BENCHMARKS, table  # the page's table (docs/benchmarks.md), one renderer

    head = (f"machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, ours torch {torch.__version__}\n\n")
    return head + table("engine", BENCHMARKS["engine"].rows(results))


if __name__ == "__main__":
    main()
