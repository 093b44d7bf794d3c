"""The lint and schema tools the deploy tests run (installed with the test extras)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``name`` from this virtualenv's bin folder; fails the test if it is missing."""
    tool = shutil.which(name, path=str(Path(sys.executable).parent))
    assert tool, f"{name} is installed with the test extras (pyproject.toml)"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)
