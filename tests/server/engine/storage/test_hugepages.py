"""Large host columns are advised transparent huge pages (random-row gathers: fewer TLB misses)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from replay_server.engine.schema import FieldSpec
from replay_server.engine.storage import hugepages
from replay_server.engine.storage.memory import HostColumn

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor`` carries the ``hg`` (MADV_HUGEPAGE) flag."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="Linux transparent huge pages")
def test_a_large_column_is_advised_and_a_small_one_is_not() -> None:
    large = HostColumn(FieldSpec(torch.uint8, (4, 84, 84)), 1000)  # 27 MiB
    small = HostColumn(FieldSpec(torch.float32, ()), 1000)
    assert _advised(large.tensor)
    assert not hugepages.advise_huge_pages(small.tensor) and not _advised(small.tensor)
    large.tensor[7] = 3  # contents as before
    assert int(large.tensor[7].sum()) == 3 * 4 * 84 * 84 and int(large.tensor[8].sum()) == 0


def test_what_cannot_be_advised_is_left_alone() -> None:
    assert not hugepages.advise_huge_pages(torch.empty(0, dtype=torch.uint8))
    assert not hugepages.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # small
