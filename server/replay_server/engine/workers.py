"""Threads that share one large numpy operation: copies, gathers, searches.

numpy releases the GIL while it copies, gathers or searches large arrays, so
a large operation split by rows runs on several cores. The caller runs one
part itself and waits for the others: the operation is still synchronous,
under the caller's lock. The pool is the process's, created on first use,
with :data:`THREADS` - 1 threads.

Where splitting pays depends on the work: a gather is memory-latency bound
and gains from a second thread even on 2 cores; bandwidth-bound copies and
searches only gain with cores to spare (:data:`MANY_CORES`), and on 2 busy
cores a second thread measured slower.

Thread-safety: :func:`run_split` may be called from any thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads one operation may use (the caller's included)."""

MANY_CORES = THREADS >= 4
"""Whether bandwidth-bound work is split at all."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="replay-split")
    return _pool


def run_split(work: Callable[[T], object], tasks: Sequence[T], parts: int) -> None:
    """Run ``work(task)`` for every task on ``parts`` threads (this one included), then return.

    Raises whatever a task raised (after every part has finished).
    """
    groups = [tasks[i::parts] for i in range(parts)]

    def run(group: Sequence[T]) -> None:
        for task in group:
            work(task)

    futures = [_threads().submit(run, group) for group in groups[1:] if group]
    try:
        run(groups[0])
    finally:
        for future in futures:
            future.result()


PARALLEL_BYTES = 2 << 20
"""Gathers at least this large are split across the pool."""


GATHER_THREADS = min(4, THREADS)
"""Threads one gather may use: a gather of random rows is bound by memory bandwidth
beyond a few threads (a 7.2 MB gather of 256 Atari rows on a 16-core H200 host: 1.01,
0.69, 0.52 and 0.58 ms on 1, 2, 4 and 8 threads; benchmarks/delivery_stages.py)."""


def _pieces(nbytes: int, rows: int) -> int:
    """How many threads a gather of ``nbytes`` in ``rows`` rows is worth (1: this one)."""
    if nbytes < PARALLEL_BYTES:
        return 1
    return max(1, min(GATHER_THREADS, rows, nbytes // (PARALLEL_BYTES // 2)))


def take_rows(src: Any, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[rows]``; large gathers run on several threads (numpy releases the GIL).

    A 7 MB gather of Atari rows is memory-latency bound on one core: two
    threads make it about 1.5x faster on a 2-core machine. ``mode="clip"``:
    with an ``out`` and the default ``mode="raise"`` numpy gathers into a
    temporary and copies it over (to leave ``out`` untouched on a bad index);
    slots come from the table's own ring, never out of range. An ``out`` whose
    rows are apart is gathered into a new buffer and copied over (numpy would
    first copy ``out`` into its own buffer, then back).
    """
    if out.nbytes < PARALLEL_BYTES and out.flags.c_contiguous:  # the common small gather
        src.take(rows, axis=0, out=out, mode="clip")
        return
    if not out.flags.c_contiguous:  # e.g. the last frame of each stack
        gathered = np.empty(out.shape, dtype=out.dtype)
        take_rows(src, rows, gathered)
        np.copyto(out, gathered)
        return
    parts = _pieces(out.nbytes, len(rows))
    if parts < 2:
        src.take(rows, axis=0, out=out, mode="clip")
        return
    bounds = np.linspace(0, len(rows), parts + 1).astype(int)
    tasks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    run_split(
        lambda t: np.take(src, rows[t[0]:t[1]], axis=0, out=out[t[0]:t[1]], mode="clip"),
        tasks, parts)
