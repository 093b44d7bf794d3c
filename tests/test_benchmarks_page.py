"""docs/benchmarks.md shows today's figures first: one section per area, each table with its
command, machine and date, and the tables the benchmarks' JSON renders kept equal to it.

``benchmarks/report.py`` renders the headline and the engine, service and learner tables from
the stored runs in ``benchmarks/results/``; these tests run it as a user would (its command
line, real files) and read the page the way a reader does (sections, tables, the lines above
each table).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
SCRIPT = ROOT / "benchmarks" / "report.py"

AREAS = ("Engine", "Service and streams", "Learner delivery", "Inserts and the Writer",
         "Sharding", "Write-ahead log", "TorchRL buffer overhead", "Ray", "GPU")
"""The areas a reader looks for, each a section of the page (their anchors are linked)."""


def _report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


report = _report()


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def _tables(section: str) -> list[tuple[str, list[str]]]:
    """(the text since the previous table, the table's lines) for each table in ``section``."""
    found, before, table = [], [], []
    for line in section.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            found.append(("\n".join(before), table))
            before, table = [], []
        before.append(line)
    if table:
        found.append(("\n".join(before), table))
    return found


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)


# ------------------------------------------------------------------------- the page


def test_the_headline_comes_first_and_the_areas_follow():
    names = list(_sections(PAGE.read_text()))
    assert names[0].startswith("Headline"), names
    assert [n for n in names if n in AREAS] == list(AREAS)


@pytest.mark.parametrize("area", AREAS)
def test_each_area_has_a_table_with_its_command_machine_and_date(area):
    tables = _tables(_sections(PAGE.read_text())[area])
    assert tables, f"section {area!r} has no table"
    for before, table in tables:
        assert len(table) >= 3 and re.fullmatch(r"\|[-:|]+\|", table[1]), table[:2]
        for field in ("Command", "Machine", "Date"):
            assert re.search(rf"^- \*\*{field}:\*\* \S", before, re.MULTILINE), (
                f"{area!r}: the table starting {table[0]!r} has no {field} line above it")


def test_every_table_below_the_headline_says_where_it_comes_from():
    """Also the areas beyond the nine (storage, checkpoints, metrics) and those added later."""
    for name, section in list(_sections(PAGE.read_text()).items())[1:]:
        for before, table in _tables(section):
            assert "**Command:**" in before and "**Date:**" in before, (name, table[0])


def test_the_page_is_not_a_diary():
    text = PAGE.read_text()
    assert "`git log -p docs/benchmarks.md`" in text
    dated = [h for h in re.findall(r"^#+ .*$", text, re.MULTILINE)
             if re.search(r"20\d\d-\d\d-\d\d", h)]
    assert not dated, f"headings name runs, not areas: {dated}"


def test_the_generated_blocks_are_what_the_stored_runs_render():
    text = PAGE.read_text()
    assert report.render_page(text, report.load_runs()) == text, (
        "run: python benchmarks/report.py render --write docs/benchmarks.md")
    assert _cli("render", "--check", str(PAGE)).returncode == 0


def test_the_headline_shows_a_ratio_for_every_pick_the_stored_runs_hold():
    headline = re.search(r"<!-- report:headline -->\n(.*?)<!-- /report:headline -->",
                         PAGE.read_text(), re.DOTALL).group(1)
    rows = [line for line in headline.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(report.HEADLINE) + 1  # and the head
    first = rows[1].split(" | ")
    assert first[0] == "| prioritized sample + update, 1M rows, batch 256"
    assert first[1:4] == ["0.608 ms", "TorchRL 0.14.1: 0.738 ms", "**1.21x**"]


# -------------------------------------------------------------------- the generator

SAMPLE = [
    {"case": "prioritized", "rows": 1_000_000, "batch": 256, "ours": {"median_s": 0.0005},
     "torchrl": {"median_s": 0.001}, "ratios": [2.0]},
    {"case": "insert", "rows": 1_000_000, "batch": 1000, "ours": {"rows_per_s": 9_000_000.0},
     "torchrl": {"rows_per_s": 3_000_000.0}, "ratios": [3.0]},
    {"case": "slice", "rows": 50_000_000, "batch": 256, "ours": {"median_s": 0.001},
     "torchrl": None, "ratios": [None]},
]
"""The shape ``benchmarks/engine.py --json`` writes (TorchRL missing from one case)."""


def test_a_recorded_run_renders_its_table(tmp_path):
    raw, out = tmp_path / "engine.json", tmp_path / "results" / "engine.json"
    raw.write_text(json.dumps(SAMPLE))
    done = _cli("record", "engine", str(raw), "--command", "make bench-engine", "--out", str(out),
                "--date", "2030-01-02 03:04 UTC")
    assert done.returncode == 0, done.stderr
    stored = json.loads(out.read_text())
    assert stored["results"] == SAMPLE and stored["command"] == "make bench-engine"
    assert re.search(r"\d+ cores", stored["machine"]) and "load average" in stored["machine"]
    assert re.fullmatch(r"[0-9a-f]{7,}( with uncommitted changes)?", stored["commit"])

    lines = report.render_run(report.load_run(out)).splitlines()
    assert lines[:3] == ["- **Command:** `make bench-engine`", f"- **Machine:** {stored['machine']}",
                         f"- **Date:** 2030-01-02 03:04 UTC, commit `{stored['commit']}`"]
    assert lines[6:] == [
        "| prioritized sample + update | 1,000,000 | 256 | 0.500 ms | 1.000 ms | 2.00x |",
        "| insert (extend) | 1,000,000 | 1,000 | 9,000,000 rows/s | 3,000,000 rows/s | 3.00x |",
        "| slice sample 256 x 32 (after a 1,000-row insert) | 50,000,000 | 256 | 1.000 ms | n/a "
        "| n/a |",
    ]


def test_the_headline_says_not_measured_where_no_run_has_the_figure(tmp_path):
    (tmp_path / "engine.json").write_text(json.dumps(
        {"benchmark": "engine", "command": "c", "machine": "m", "date": "2030-01-02",
         "commit": "", "note": "", "results": SAMPLE}))
    runs = report.load_runs(tmp_path)
    lines = report.render_headline(runs).splitlines()
    assert ("| prioritized sample + update, 1M rows, batch 256 | 0.500 ms | TorchRL 0.14.1: "
            "1.000 ms | **2.00x** | [engine, 2030-01-02](#engine) |") in lines
    assert "| slice sample 256 x 32 at 50M rows | 1.000 ms | TorchRL 0.14.1: n/a | **n/a** " \
           "| [engine, 2030-01-02](#engine) |" in lines
    assert "| Atari batches to a learner, gRPC | not measured yet | | | |" in lines


def test_record_refuses_a_file_the_benchmark_did_not_write(tmp_path):
    service = json.loads((ROOT / "benchmarks" / "results" / "service.json").read_text())
    raw, out = tmp_path / "service.json", tmp_path / "engine.json"
    raw.write_text(json.dumps(service["results"]))
    out.write_text("kept\n")
    done = _cli("record", "engine", str(raw), "--command", "x", "--out", str(out))
    assert done.returncode == 2
    assert str(raw) in done.stderr and "benchmarks/engine.py --json" in done.stderr
    assert out.read_text() == "kept\n"
    raw.write_text("{not json")
    done = _cli("record", "engine", str(raw), "--command", "x", "--out", str(out))
    assert done.returncode == 2 and "cannot read it as JSON" in done.stderr


def test_check_finds_a_stale_page_and_write_mends_it(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE.read_text().replace("| 0.608 ms | 0.738 ms | 1.21x |",
                                             "| 0.500 ms | 0.738 ms | 1.48x |"))
    done = _cli("render", "--check", str(page))
    assert done.returncode == 1 and "render --write" in done.stderr
    assert _cli("render", "--write", str(page)).returncode == 0
    assert page.read_text() == PAGE.read_text()


def test_a_page_without_a_block_is_refused():
    with pytest.raises(report.ResultsError, match="report:headline"):
        report.render_page("# Benchmarks\n", report.load_runs())


def test_the_chart_draws_the_headline_ratios(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart.png"
    runs = report.load_runs()
    drawn = report.chart(runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = [(label, row.ratio) for label, row, _ in report.headline_rows(runs) if row]
    assert drawn == expected and len(drawn) == len(report.HEADLINE)
    assert (ROOT / "docs" / "images" / "benchmarks-headline.png").stat().st_size > 10_000


@pytest.mark.slow
def test_what_the_engine_benchmark_writes_is_recorded_and_rendered(tmp_path):
    """The real benchmark's ``--json`` (inserts only, no TorchRL: about 40 s here)."""
    raw, out = tmp_path / "engine.json", tmp_path / "results" / "engine.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--only", "insert",
                    "--json", str(raw)], cwd=ROOT, capture_output=True, timeout=600, check=True)
    done = _cli("record", "engine", str(raw), "--command", "engine.py --only insert",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = report.rows_of(report.load_run(out))
    assert [row.key for row in rows] == ["insert 1000000 1000", "insert 1000000 100000"]
    assert all(row.anchor == "n/a" and row.ratio is None for row in rows)
    assert all(re.fullmatch(r"[\d,]+ rows/s", row.ours) for row in rows)
