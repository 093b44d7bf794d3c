"""Pages ahead of the write cursor become resident in the background, contents untouched."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from replay_server.engine import prefault
from replay_server.engine.schema import FieldSpec, Schema

from tests.conftest import wait_for
from tests.server.engine.test_storage import in_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")

_PAGE = 4096


def _resident_pages(tensor: torch.Tensor) -> int:
    """Pages of ``tensor``'s own memory that are resident (mincore), whatever the rest
    of the process does: a process-wide RSS moves with every other test's frees."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    address = tensor.data_ptr()
    first = address & ~(_PAGE - 1)
    length = address + tensor.numel() * tensor.element_size() - first
    pages = (length + _PAGE - 1) // _PAGE
    flags = np.zeros(pages, dtype=np.uint8)
    if libc.mincore(first, length, flags.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((flags & 1).sum())


def _no_job_running() -> bool:
    worker = prefault._worker
    return worker is None or not worker.is_alive()


def _pages_after_a_write_are_resident_up_to_the_bound() -> None:
    """The scenario of the test below, in a process of its own (see there)."""
    schema = Schema({"x": FieldSpec(torch.uint8, (4096,))})  # one page per row
    storage = in_memory(schema, capacity=(prefault.AHEAD_BYTES >> 12) * 4)  # 256 MiB
    column = storage.columns["x"].tensor
    assert _resident_pages(column) < 16, "lazily backed: nothing written yet"
    storage.write(0, {"x": torch.ones(1, 4096, dtype=torch.uint8)})
    assert prefault._supported
    ahead = prefault.AHEAD_BYTES // _PAGE
    assert wait_for(lambda: _resident_pages(column) >= ahead, timeout=60)
    assert wait_for(_no_job_running, timeout=60)
    # Bounded: the rest of the 256 MiB is not backed until inserts get near it.
    assert _resident_pages(column) <= ahead + 16
    assert torch.equal(column[0], torch.ones(4096, dtype=torch.uint8))
    assert int(column[1:].sum()) == 0  # made resident, contents untouched (zero pages)


def test_a_write_makes_the_pages_after_it_resident_up_to_the_bound():
    # In a fresh interpreter: in a test worker that ran other tests, malloc may serve the
    # 256 MiB from a free stretch of its heap, resident already and holding old bytes (CI
    # saw every page resident, filled with 255), where fresh memory is lazily backed zeros.
    done = subprocess.run(
        [sys.executable, "-c", "from tests.server.engine.test_prefault import "
         "_pages_after_a_write_are_resident_up_to_the_bound as run; run()"],
        cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_write_while_another_job_runs_is_made_resident_by_a_later_write():
    assert wait_for(_no_job_running, timeout=60)
    schema = Schema({"x": FieldSpec(torch.uint8, (4096,))})
    first = in_memory(schema, capacity=(prefault.AHEAD_BYTES >> 12) * 2)
    second = in_memory(schema, capacity=(prefault.AHEAD_BYTES >> 12) * 2)
    first.write(0, {"x": torch.ones(1, 4096, dtype=torch.uint8)})
    second.write(0, {"x": torch.ones(1, 4096, dtype=torch.uint8)})  # may be put off
    assert wait_for(_no_job_running, timeout=60)
    second.write(1, {"x": torch.ones(1, 4096, dtype=torch.uint8)})
    ahead = prefault.AHEAD_BYTES // _PAGE
    column = second.columns["x"].tensor
    assert wait_for(lambda: _resident_pages(column) >= ahead, timeout=60)


def test_contents_written_while_pages_are_made_resident_are_kept():
    schema = Schema({"x": FieldSpec(torch.int64, (512,))})
    storage = in_memory(schema, capacity=50_000)
    rows = torch.arange(50_000 * 512, dtype=torch.int64).view(50_000, 512)
    for first in range(0, 50_000, 700):
        storage.write(first, {"x": rows[first:first + 700]})
    assert torch.equal(storage.columns["x"].tensor, rows)
