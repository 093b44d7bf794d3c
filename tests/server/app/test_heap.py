"""The standalone server keeps its heap for large requests instead of faulting them in afresh."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
from replay_server.app import heap

linux_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallopt"),
    reason="the heap thresholds are glibc's")



@linux_glibc
def test_keep_request_buffers_sets_both_thresholds() -> None:
    # In a process of its own: the thresholds are process-wide.
    check = ("from replay_server.app.heap import keep_request_buffers\n"
             "raise SystemExit(0 if keep_request_buffers() else 1)")
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0


def test_keep_request_buffers_is_a_no_op_without_mallopt(monkeypatch) -> None:
    class NoMallopt:  # e.g. musl's libc
        def __init__(self, *_args: object) -> None:
            pass

    monkeypatch.setattr(heap.ctypes, "CDLL", NoMallopt)
    assert heap.keep_request_buffers() is False
