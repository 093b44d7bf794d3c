"""Fresh storage pages made resident ahead of the ring's write cursor, off the insert's path.

Table storage is allocated once and left to the OS to back lazily, so the
first write to each 4 KiB page takes a page fault (and the kernel zeroes the
page). For a table still filling that is most of an insert's cost on the
server: 256 Atari rows (7 MB) took about 3 ms of faults on top of a 1 ms
copy. :class:`Prefaulter` moves that work to a background thread: after each
write it asks the kernel (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) to
back the next :data:`AHEAD_BYTES` of every column beyond the cursor, before
the next insert needs them. That call never changes memory contents, so it
may run while inserts write the same pages; the numpy views it holds keep
the memory alive until it returns.

Bounds: at most :data:`AHEAD_BYTES` of storage beyond what inserts have
reached is made resident (memory the table's capacity has claimed anyway),
and only until the ring has been filled once. Where the call is unsupported
(another OS, an older kernel) nothing happens and writes fault as before.

Thread-safety: :meth:`Prefaulter.advance` is called by the owning storage's
writer (under its table's lock); the work runs on a short-lived thread, one
job at a time in the process.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any
from collections.abc import Iterable

import numpy as np

AHEAD_BYTES = 64 << 20
"""How far ahead of the write cursor pages are made resident (all columns together)."""

_MADV_POPULATE_WRITE = 23
_PAGE = 4096

_worker: threading.Thread | None = None  # the job in progress, if any
_worker_lock = threading.Lock()
_supported = sys.platform.startswith("linux")
_madvise: Any = None  # libc madvise, where there is one
if _supported:
    try:
        # The process' own symbols: libc's madvise, without find_library's ldconfig
        # subprocess (a fork, unsafe once gRPC's threads run).
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _supported = False


class Prefaulter:
    """Keeps pages resident ahead of one storage's write cursor (see the module docstring).

    Args:
        capacity: rows per column.
        row_bytes: bytes of one row, all columns together.
    """

    def __init__(self, capacity: int, row_bytes: int) -> None:
        self._capacity = capacity
        self._ahead = max(1, AHEAD_BYTES // max(1, row_bytes))
        self._resident = 0  # rows [0, resident) were made resident (or asked to be)

    def advance(self, views: Iterable[np.ndarray], cursor: int) -> None:
        """The next write starts at row ``cursor``: keep the rows after it resident."""
        if not _supported or self._resident >= self._capacity:
            return
        if cursor + self._ahead // 2 < self._resident:
            return  # still well ahead
        start, stop = self._resident, min(self._capacity, cursor + self._ahead)
        if stop > start and _start([view[start:stop] for view in views]):
            self._resident = stop


def _start(views: list[np.ndarray]) -> bool:
    """Populate ``views`` on a thread of its own; False (try later) while another job runs.

    A thread per job (one every ``AHEAD_BYTES / 2`` of inserts, ending with it)
    rather than a pool, so nothing is left running once the tables stop growing.
    """
    global _worker
    with _worker_lock:
        if _worker is not None and _worker.is_alive():
            return False
        _worker = threading.Thread(target=_populate, args=(views,), name="replay-prefault",
                                   daemon=True)
        _worker.start()
        return True


def _populate(views: list[np.ndarray]) -> None:
    global _supported
    for view in views:
        address = view.ctypes.data
        first = address & ~(_PAGE - 1)
        last = (address + view.nbytes + _PAGE - 1) & ~(_PAGE - 1)
        if last > first and _madvise(first, last - first, _MADV_POPULATE_WRITE) != 0:
            _supported = False  # e.g. EINVAL before Linux 5.14: writes fault as before
            return
