"""Running one side of a side-by-side benchmark in its own process (and virtualenv)."""

from __future__ import annotations

import json
import subprocess
import sys


def run_side(cmd: list[str], timeout: float) -> dict | None:
    """Run ``cmd`` and return the last JSON object it printed; ``None`` (reported) if it failed."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"  timed out: {' '.join(cmd)}", file=sys.stderr)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}",
              file=sys.stderr)
        return None
    return json.loads(lines[-1])
