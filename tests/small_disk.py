"""A small disk for tests that need one to fill: a tmpfs of a given size, mounted for a test.

Mounting needs root (CAP_SYS_ADMIN); where it is not permitted the test is
skipped with that reason. The mount is removed when the test ends, with
everything on it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` bytes at ``path`` (created) for the block's duration."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(path)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root and mount): "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(disk: Path, leave: int) -> Path:
    """Write a file on ``disk`` that leaves about ``leave`` bytes free; returns its path."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as file:
        file.write(b"\0" * max(free - leave, 0))
    return filler
