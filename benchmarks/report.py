"""Today's figures for docs/benchmarks.md, rendered from the JSON the benchmarks write.

    python benchmarks/engine.py --torchrl-python .venv-torchrl/bin/python --json engine.json
    python benchmarks/report.py record engine engine.json --command "make bench-engine"
    python benchmarks/report.py render --write docs/benchmarks.md
    python benchmarks/report.py chart

A *run* is one benchmark's ``--json`` output (``engine.py``, ``service.py``,
``learner.py``) wrapped with what the page says beside every table: the
command, the machine and the date (``record`` adds the machine, the date and
the commit it finds, and checks that the file renders). The newest run of each
benchmark is kept in ``benchmarks/results/<benchmark>.json``; the page's
generated blocks, between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``,
are what ``render`` makes of those files: one table per benchmark and the
headline (the ratios against the anchors, TorchRL and Reverb, picked from the
three). ``chart`` draws the headline's ratios as a PNG (matplotlib, which the
project's test extra installs). ``render --check`` exits 1 when the page's
blocks differ from what the stored runs render.

Every ratio reads the same way: above 1, replay-server is ahead of the anchor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "images" / "benchmarks-headline.png"


class ResultsError(ValueError):
    """A results file or page that cannot be rendered; the message names the file and the fault."""


@dataclass(frozen=True)
class Run:
    """One benchmark run as the page shows it: its figures and where they come from."""

    benchmark: str
    command: str
    machine: str
    date: str
    commit: str
    note: str
    results: object


@dataclass(frozen=True)
class Row:
    """One line of a benchmark's table; ``key`` names it for the headline's picks."""

    key: str
    cells: tuple[str, ...]
    ours: str
    anchor: str
    ratio: float | None


# ----------------------------------------------------------------------- the tables


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _engine_row(record: dict) -> Row:
    """engine.py's row: TorchRL's time over ours (our rate over TorchRL's for inserts)."""
    case, ours, theirs = record["case"], record["ours"] or {}, record["torchrl"] or {}
    if case == "insert":
        a, b = ours.get("rows_per_s"), theirs.get("rows_per_s")
        shown = (f"{a:,.0f} rows/s" if a else "n/a", f"{b:,.0f} rows/s" if b else "n/a")
        ratio, label = (a / b if a and b else None), "insert (extend)"
    elif case == "memory":
        a, b = ours.get("ratio"), theirs.get("ratio")
        shown = (f"{a:.3f}x raw ({ours['ratio_untrimmed']:.3f}x untrimmed)" if a else "n/a",
                 f"{b:.3f}x raw ({theirs['ratio_untrimmed']:.3f}x untrimmed)" if b else "n/a")
        ratio, label = (b / a if a and b else None), "memory: RSS growth / raw row bytes"
    elif case in ("prioritized", "slice"):
        a, b = ours.get("median_s"), theirs.get("median_s")
        shown, ratio = (_ms(a), _ms(b)), (b / a if a and b else None)
        if ours.get("cpu_median_s") and theirs.get("cpu_median_s"):  # each side's own CPU
            shown = tuple(f"{ms} (CPU {_ms(side['cpu_median_s'])}, {side.get('threads', '?')} "
                          f"threads)" for ms, side in zip(shown, (ours, theirs), strict=True))
        label = ("prioritized sample + update" if case == "prioritized"
                 else "slice sample 256 x 32 (after a 1,000-row insert)")
    else:
        raise KeyError(f"case {case!r}")
    key = f"{case} {record['rows']} {record['batch']}"
    spread = [x for x in record.get("ratios", []) if x is not None]  # one per round (--repeat)
    ratio_cell = _x(ratio) + (f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1
                              else "")
    cells = (label, f"{record['rows']:,}", f"{record['batch']:,}", *shown, ratio_cell)
    return Row(key, cells, shown[0], shown[1], ratio)


def _service_rows(record: dict) -> list[Row]:
    """service.py's rows of one kind and case: our rate over Reverb's."""
    theirs = record["reverb"] or {}
    metric, unit = {"update": ("ids_per_s", "ids/s"),
                    "publish": ("calls_per_s", "calls/s")}.get(record["case"],
                                                               ("rows_per_s", "rows/s"))
    base = theirs.get(metric)
    rows = []
    for ours in record["ours"]:
        value = ours[metric]
        mb = f", {ours['mb_per_s']:,.1f} MB/s" if "mb_per_s" in ours else ""
        their_mb = f", {theirs['mb_per_s']:,.1f} MB/s" if theirs.get("mb_per_s") else ""
        anchor = f"{base:,.0f} {unit}{their_mb} ({theirs.get('api', '')})" if base else "n/a"
        ratio = value / base if base else None
        shown = f"{value:,.0f} {unit}{mb}"
        rows.append(Row(f"{record['kind']} {ours['api']}",
                        (record["kind"], f"{record['case']}: {ours['api']}", shown, anchor,
                         _x(ratio)), shown, anchor, ratio))
    return rows


def _learner_rows(results: dict) -> list[Row]:
    """learner.py's rows: GB/s delivered over Reverb's dataset's."""
    theirs = results.get("reverb")
    rows = []
    for path, ours in results["ours"].items():
        if path == "plain pinned copy":
            continue
        ratio = ours["gb_per_s"] / theirs["gb_per_s"] if theirs else None
        shown = f"{ours['batches_per_s']:,.1f} batches/s, {ours['gb_per_s']:.2f} GB/s"
        anchor = (f"{theirs['batches_per_s']:,.1f} batches/s, {theirs['gb_per_s']:.2f} GB/s"
                  if theirs else "n/a")
        rows.append(Row(path, (path, f"{ours['batches_per_s']:,.1f}", f"{ours['gb_per_s']:.2f}",
                               _x(ratio)), shown, anchor, ratio))
    return rows


@dataclass(frozen=True)
class Benchmark:
    """How one benchmark's JSON becomes rows, and the head of its table."""

    script: str
    anchor: str
    head: tuple[str, ...]
    align: str
    rows: Callable[[Any], list[Row]]


BENCHMARKS = {
    "engine": Benchmark(
        "benchmarks/engine.py", "TorchRL 0.14.1",
        ("case", "rows", "batch", "replay-server", "TorchRL 0.14.1", "ratio (TorchRL / ours)"),
        "|---|---:|---:|---:|---:|---:|",
        lambda results: [_engine_row(r) for r in results]),
    "service": Benchmark(
        "benchmarks/service.py", "Reverb 0.14.0",
        ("rows", "operation", "replay-server", "Reverb 0.14.0", "ratio (ours / Reverb)"),
        "|---|---|---:|---:|---:|",
        lambda results: [row for r in results for row in _service_rows(r)]),
    "learner": Benchmark(
        "benchmarks/learner.py", "Reverb 0.14.0 TrajectoryDataset",
        ("path", "batches/s", "GB/s", "vs Reverb's dataset"), "|---|---:|---:|---:|",
        _learner_rows),
}
"""The benchmarks whose ``--json`` the page renders, by the name ``record`` takes."""


def rows_of(run: Run, where: str = "") -> list[Row]:
    """The rows of ``run``'s table; :class:`ResultsError` if its results are not that benchmark's."""
    try:
        return BENCHMARKS[run.benchmark].rows(run.results)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ResultsError(f"{where or run.benchmark}: not the JSON that "
                           f"{BENCHMARKS[run.benchmark].script} --json writes "
                           f"(missing or wrong: {exc})") from exc


def table(benchmark: str, rows: list[Row]) -> str:
    """A benchmark's markdown table: what the benchmark prints and the page shows."""
    bench = BENCHMARKS[benchmark]
    lines = ["| " + " | ".join(bench.head) + " |", bench.align]
    return "\n".join(lines + ["| " + " | ".join(row.cells) + " |" for row in rows])


def render_run(run: Run) -> str:
    """A benchmark's block: command, machine and date, its table, and its note."""
    lines = [f"- **Command:** `{run.command}`", f"- **Machine:** {run.machine}",
             f"- **Date:** {run.date}" + (f", commit `{run.commit}`" if run.commit else ""),
             "", table(run.benchmark, rows_of(run))]
    if run.note:
        lines += ["", run.note]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the headline

HEADLINE = (
    ("engine", "prioritized 1000000 256", "prioritized sample + update, 1M rows, batch 256"),
    ("engine", "prioritized 10000000 256", "prioritized sample + update, 10M rows, batch 256"),
    ("engine", "prioritized 1000000 65536", "prioritized sample + update, 1M rows, batch 65,536"),
    ("engine", "slice 1000000 256", "slice sample 256 x 32 at 1M rows"),
    ("engine", "slice 50000000 256", "slice sample 256 x 32 at 50M rows"),
    ("engine", "insert 1000000 1000", "insert, 1,000 rows per call"),
    ("engine", "memory 10000000 0", "memory of a 10M-row table, TorchRL's over ours"),
    ("service", "atari insert (256 rows per call)", "Atari rows, insert of 256 per call"),
    ("service", "atari Writer.append (per step)", "Atari rows, Writer.append per step"),
    ("service", "atari sample (batch 256)", "Atari rows, unary sample(256) (same host: shared memory)"),
    ("service", "atari sample (batch 256, another host: gRPC)",
     "Atari rows, unary sample(256) (another host: gRPC)"),
    ("service", "atari stream (batch 256, plain: grouping chosen)",
     "Atari rows, stream(256) (same host: shared memory)"),
    ("service", "small insert (8192 rows per call)", "17-float rows, insert of 8,192 per call"),
    ("service", "small Writer.append (per step)", "17-float rows, Writer.append per step"),
    ("service", "small sample (batch 256)", "17-float rows, unary sample(256) (same host: shared memory)"),
    ("service", "small sample (batch 256, another host: gRPC)",
     "17-float rows, unary sample(256) (another host: gRPC)"),
    ("service", "small stream (batch 256, plain: grouping chosen)", "17-float rows, stream(256)"),
    ("service", "small update_priorities (128 ids per call)",
     "17-float rows, priority updates of 128 ids, waiting (same host: local socket)"),
    ("service", "small update_priorities (128 ids per call, another host: gRPC)",
     "17-float rows, priority updates of 128 ids, waiting (another host: gRPC)"),
    ("service", "small update_priorities (1024 ids per call, wait=False)",
     "17-float rows, priority updates of 1,024 ids, wait=False"),
    ("learner", "grpc", "Atari batches to a learner, gRPC"),
    ("learner", "shared memory", "Atari batches to a learner, shared memory"),
    ("learner", "in process", "Atari batches to a learner, in process"),
)
"""The headline's picks: (benchmark, row key, label), in the order shown."""

AREAS = {"engine": "engine", "service": "service-and-streams", "learner": "learner-delivery"}
"""The page's section (its anchor) that holds each benchmark's whole table."""


def headline_rows(runs: dict[str, Run]) -> list[tuple[str, Row | None, Run | None]]:
    """(label, row, run) per pick; row and run ``None`` where no stored run has it."""
    picked = []
    for benchmark, key, label in HEADLINE:
        run = runs.get(benchmark)
        rows = {row.key: row for row in rows_of(run)} if run else {}
        picked.append((label, rows.get(key), run))
    return picked


def render_headline(runs: dict[str, Run]) -> str:
    lines = ["| figure | replay-server | anchor | ratio | run |", "|---|---:|---:|---:|---|"]
    for label, row, run in headline_rows(runs):
        if row is None or run is None:
            lines.append(f"| {label} | not measured yet | | | |")
            continue
        date = run.date.split(",")[0].split(" ")[0]
        where = f"[{run.benchmark}, {date}](#{AREAS[run.benchmark]})"
        anchor = f"{BENCHMARKS[run.benchmark].anchor}: {row.anchor}"
        lines.append(f"| {label} | {row.ours} | {anchor} | **{_x(row.ratio)}** | {where} |")
    return "\n".join(lines)


def chart(runs: dict[str, Run], out: Path) -> list[tuple[str, float]]:
    """Draw the headline's ratios (log scale, 1 = even) into ``out``; returns what it drew."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the chart needs matplotlib: .venv/bin/python -m pip install "
                         "matplotlib (make install brings it with the test extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [(label, row.ratio, run.benchmark) for label, row, run in headline_rows(runs)
             if row is not None and run is not None and row.ratio]
    colours = {"engine": "#4c72b0", "service": "#dd8452", "learner": "#55a868"}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(drawn) + 1.4))
    y = list(range(len(drawn)))[::-1]
    # Bars grow from 1 (even), right where we are ahead, left where we are not.
    ax.barh(y, [r - 1 for _, r, _ in drawn], left=1, color=[colours[b] for _, _, b in drawn])
    ax.set_yticks(y, [label for label, _, _ in drawn], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(0.3, max(r for _, r, _ in drawn) * 4)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for yy, (_, ratio, _) in zip(y, drawn):
        ax.text(max(ratio, 1.0), yy, f" {ratio:.2f}x", va="center", fontsize=7)
    ax.set_xlabel("ratio against the anchor (above 1: replay-server ahead; log scale)")
    dates = ", ".join(f"{name} {run.date.split(',')[0].split(' ')[0]}"
                      for name, run in sorted(runs.items()))
    ax.set_title("replay-server against TorchRL (engine) and Reverb (service, learner)\n"
                 f"newest runs: {dates}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return [(label, ratio) for label, ratio, _ in drawn]


# ------------------------------------------------------------------ runs and the page


def load_run(path: Path) -> Run:
    """A stored run; :class:`ResultsError` naming the file if it is not one."""
    try:
        data = json.loads(path.read_text())
        run = Run(**{field: data[field] for field in Run.__dataclass_fields__})
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ResultsError(f"{path}: not a stored run ({exc!r})") from exc
    if run.benchmark not in BENCHMARKS:
        raise ResultsError(f"{path}: unknown benchmark {run.benchmark!r}; "
                           f"known: {sorted(BENCHMARKS)}")
    rows_of(run, str(path))
    return run


def load_runs(folder: Path = RESULTS) -> dict[str, Run]:
    runs = [load_run(path) for path in sorted(folder.glob("*.json"))]
    return {run.benchmark: run for run in runs}


def blocks(runs: dict[str, Run]) -> dict[str, str]:
    """What goes between each pair of markers on the page."""
    out = {"headline": render_headline(runs)}
    out.update({name: render_run(run) for name, run in runs.items()})
    return out


def render_page(text: str, runs: dict[str, Run], where: str = "the page") -> str:
    """``text`` with every generated block replaced; every stored run needs its markers."""
    made = blocks(runs)
    for name, body in made.items():
        pattern = re.compile(rf"(<!-- report:{name} -->\n)(?:.*?\n)?(<!-- /report:{name} -->)",
                             re.DOTALL)
        if not pattern.search(text):
            raise ResultsError(f"{where} has no <!-- report:{name} --> ... "
                               f"<!-- /report:{name} --> block for it")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def _machine() -> str:
    """This machine in the page's words: architecture, cores, memory, GPU, Python, load."""
    try:
        found = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
    except OSError:
        found = None
    memory = f", {int(found.group(1)) / 2**20:.0f} GiB" if found else ""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.device_count() else "no GPU"
    except ImportError:
        gpu = "GPU unknown (no torch)"
    load = os.getloadavg()[2]
    return (f"{platform.machine()}, {os.cpu_count()} cores{memory}, {gpu}, Python "
            f"{platform.python_version()}; load average {load:.1f} over the 15 min before "
            f"it was recorded")


def _commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    return f"{commit} with uncommitted changes" if commit and git("status", "--porcelain") \
        else commit


def record(benchmark: str, raw: Path, command: str, out: Path, note: str = "",
           machine: str | None = None, date: str | None = None) -> Run:
    """Wrap ``raw`` (a benchmark's ``--json``) as a run and write it to ``out``.

    Checks that it renders first: a file the benchmark did not write is refused
    with :class:`ResultsError` and ``out`` is left as it was.
    """
    if benchmark not in BENCHMARKS:
        raise ResultsError(f"unknown benchmark {benchmark!r}; known: {sorted(BENCHMARKS)}")
    try:
        results = json.loads(raw.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{raw}: cannot read it as JSON ({exc})") from exc
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run = Run(benchmark, command, machine or _machine(), date or now, _commit(), note, results)
    rows_of(run, str(raw))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run.__dict__, indent=1) + "\n")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="store a benchmark's --json as its newest run")
    rec.add_argument("benchmark", choices=sorted(BENCHMARKS))
    rec.add_argument("json", type=Path, help="the file the benchmark's --json wrote")
    rec.add_argument("--command", required=True, help="the command that produced it")
    rec.add_argument("--note", default="", help="a sentence shown under its table")
    rec.add_argument("--machine", help="default: this machine, as found now")
    rec.add_argument("--date", help="default: now (UTC)")
    rec.add_argument("--out", type=Path, help="default: benchmarks/results/BENCHMARK.json")
    ren = sub.add_parser("render", help="print the generated blocks, or put them on the page")
    ren.add_argument("--write", type=Path, help="replace the blocks on this page")
    ren.add_argument("--check", type=Path, help="exit 1 if this page's blocks are stale")
    ren.add_argument("--results", type=Path, default=RESULTS)
    cha = sub.add_parser("chart", help="the headline's ratios as a PNG")
    cha.add_argument("--out", type=Path, default=CHART)
    cha.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ResultsError as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.what == "record":
        out = args.out or RESULTS / f"{args.benchmark}.json"
        record(args.benchmark, args.json, args.command, out, args.note, args.machine, args.date)
        print(f"wrote {out}; now: python benchmarks/report.py render --write docs/benchmarks.md"
              f" && python benchmarks/report.py chart")
        return 0
    runs = load_runs(args.results)
    if args.what == "chart":
        drawn = chart(runs, args.out)
        print(f"wrote {args.out} ({len(drawn)} ratios)")
        return 0
    page = args.write or args.check
    if page is None:
        for name, body in blocks(runs).items():
            print(f"<!-- report:{name} -->\n{body}\n<!-- /report:{name} -->\n")
        return 0
    text = page.read_text()
    made = render_page(text, runs, str(page))
    if args.check:
        if made != text:
            print(f"{page}: its generated blocks differ from what {args.results} renders; "
                  f"run: python benchmarks/report.py render --write {page}", file=sys.stderr)
            return 1
        return 0
    page.write_text(made)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
