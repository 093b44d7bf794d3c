"""Verdicts per test from the two runs' records, and the printed table.

Scope comes from the reference run (TorchRL's own classes), as
:mod:`tests.conformance.scope` defines it: a test is in scope when it passed
there, built at least one of the public buffer classes from parts a table
can stand for, and wrote only TensorDicts to it (or nothing). Tests that
build a buffer but write other data (plain tensors, lists, tensorclasses) are
counted apart, as "other data". In scope, a test is *not applicable* when it
matches :data:`~tests.conformance.scope.NOT_APPLICABLE` (tests of TorchRL's
own internals, each with its reason), else it *passes* or *fails* as the
swapped run recorded it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conformance.scope import reason_not_applicable, reason_out_of_scope

TENSORDICT_DATA = {"tensordict"}


@dataclass(frozen=True)
class Verdict:
    nodeid: str
    verdict: str  # "pass", "fail" or "n/a"
    reason: str = ""
    group: str = "tensordict"  # "tensordict" or "other data"


def load(path: Path) -> dict[str, dict[str, Any]]:
    """Records by node id (the last record of a node id wins)."""
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["nodeid"]] = record
    return records


def verdicts(reference: dict[str, dict], remote: dict[str, dict]) -> tuple[list[Verdict], Counter]:
    """Verdicts of the tests in scope, and counts of those out of scope by why."""
    out: list[Verdict] = []
    outside: Counter = Counter()
    for nodeid, ref in reference.items():
        if ref["outcome"] != "passed":
            outside[f"{ref['outcome']} with TorchRL's own buffers"] += 1
            continue
        if not ref["buffers"]:
            outside["builds no replay buffer"] += 1
            continue
        part = reason_out_of_scope(ref.get("parts", []))
        if part:
            outside[part] += 1
            continue
        group = "tensordict" if set(ref["data"]) <= TENSORDICT_DATA else "other data"
        why = reason_not_applicable(nodeid, ref.get("private", []))
        if why:
            out.append(Verdict(nodeid, "n/a", why, group))
            continue
        mine = remote.get(nodeid)
        if mine is None:
            out.append(Verdict(nodeid, "fail", "not run (the swapped run stopped early)", group))
        elif mine["outcome"] == "passed":
            out.append(Verdict(nodeid, "pass", "", group))
        elif mine["outcome"] == "skipped":
            out.append(Verdict(nodeid, "fail", "skipped when swapped", group))
        else:
            reason = mine["error"]
            if mine.get("missing"):
                reason = f"{reason} [asked for: {', '.join(mine['missing'])}]"
            out.append(Verdict(nodeid, "fail", reason, group))
    return out, outside


def totals(found: list[Verdict], group: str) -> dict[str, int]:
    mine = [v for v in found if v.group == group]
    counts = Counter(v.verdict for v in mine)
    return {"tests": len(mine), "pass": counts["pass"], "fail": counts["fail"],
            "n/a": counts["n/a"]}


def percent(count: dict[str, int]) -> float:
    applicable = count["pass"] + count["fail"]
    return 100.0 * count["pass"] / applicable if applicable else 100.0


def causes(found: list[Verdict], top: int = 40) -> list[tuple[str, int]]:
    """Failures grouped by their error, numbers and quoted values blurred."""
    def blur(reason: str) -> str:
        reason = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
        return re.sub(r"\d+(\.\d+)?", "N", reason)[:160]

    return Counter(blur(v.reason) for v in found if v.verdict == "fail").most_common(top)


def render(found: list[Verdict], outside: Counter, *, details: bool = True) -> str:
    lines = []
    if details:
        for v in sorted(found, key=lambda v: (v.group, v.nodeid)):
            tag = {"pass": "PASS", "fail": "FAIL", "n/a": "N/A "}[v.verdict]
            extra = "" if v.group == "tensordict" else " (other data)"
            lines.append(f"{tag} {v.nodeid}{extra}" + (f"  -- {v.reason}" if v.reason else ""))
        lines.append("")
    lines.append("Out of scope (not counted):")
    for why, n in sorted(outside.items()):
        lines.append(f"  {n:5d}  {why}")
    for group, title in (("tensordict", "TensorDict data (the headline)"),
                         ("other data", "other data (plain tensors, lists, tensorclasses)")):
        count = totals(found, group)
        lines.append(f"{title}: {count['tests']} tests: {count['pass']} pass, "
                     f"{count['fail']} fail, {count['n/a']} not applicable; "
                     f"{percent(count):.1f}% of the applicable ones pass")
    return "\n".join(lines)
