"""Pages ahead of the write cursor become resident in the background, contents untouched."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from replay_server.engine import prefault
from replay_server.engine.schema import FieldSpec, Schema
from tests.conftest import wait_for
from tests.server.engine.test_storage import in_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


def _resident() -> int:
    return psutil.Process().memory_info().rss


def test_a_write_makes_the_pages_after_it_resident_up_to_the_bound():
    schema = Schema({"x": FieldSpec(torch.uint8, (4096,))})  # one page per row
    storage = in_memory(schema, capacity=(prefault.AHEAD_BYTES >> 12) * 4)  # 256 MiB
    before = _resident()
    storage.write(0, {"x": torch.ones(1, 4096, dtype=torch.uint8)})
    assert prefault._supported
    assert wait_for(lambda: _resident() - before >= prefault.AHEAD_BYTES * 0.9, timeout=20)
    # Bounded: the rest of the 256 MiB is not backed until inserts get near it.
    assert _resident() - before < prefault.AHEAD_BYTES * 1.5


def test_contents_written_while_pages_are_made_resident_are_kept():
    schema = Schema({"x": FieldSpec(torch.int64, (512,))})
    storage = in_memory(schema, capacity=50_000)
    rows = torch.arange(50_000 * 512, dtype=torch.int64).view(50_000, 512)
    for first in range(0, 50_000, 700):
        storage.write(first, {"x": rows[first:first + 700]})
    assert torch.equal(storage.columns["x"].tensor, rows)
