"""The feed's pipeline: the delivery stage on a thread of its own, and parallel host copies.

A feed's source samples (or receives) each batch into its staging slot on the
producer thread. What happens to the batch next, the learner's ``transform``,
pinning and the start of the device copy (:mod:`replay_feed.core`), runs on a
second thread, the *delivery stage*, so the producer gathers batch ``k + 1``
while batch ``k`` is transformed, pinned and copied; once issued, the device
copy runs on the accelerator's side stream by itself. Three stages, three
places: sample and gather on the producer thread (the gather split across
cores by the storage, straight into pinned staging or the shared-memory
ring), transform and pin on the delivery stage (host copies split across
cores by :class:`HostCopier`), the copy on the device's copy engine.

Order: one stage thread, first in, first out. Batches, a failure and the end
reach the learner in the order the producer delivered them.

Bound: the stage's queue adds no buffering of its own. The producer never
produces a batch outside the feed's credit window (``prefetch`` ahead of the
batch the learner holds), so the queue never holds more than ``prefetch``
batches, and they are the same staging slots as before.

Buffer reuse: unchanged by the stage. A staging slot is written again only
after the learner has taken the batch after it and that batch's device copy
has finished (see :mod:`replay_feed.core`); the learner can take it only
after the stage has handed it over, so the stage has finished reading the
slot too.

When the stage runs: when batches are copied to a device. Batches that stay
on the host are transformed and pinned inline on the producer thread: on a
2-core machine a host transform on its own thread (torch's intra-op threads)
beside the producer's parallel gather measured 1.4-1.7x slower than
running the two one after the other (the in-process path with
``benchmarks/learner.py``'s transform; docs/benchmarks.md, issue 13): the
threads of both oversubscribe the cores. A device path's stage work is
pinning copies and issuing the copy, which then runs on the device by itself.

Threads: :func:`default_threads` sizes host copies from the machine's cores:
one thread below 4 cores, else one per core up to 8 (a host copy is
bandwidth-bound; on 2 busy cores a second thread measured slower for the
engine's copies, ``replay_server.engine.workers``). ``REPLAY_FEED_THREADS``
overrides it, as does the ``threads`` argument of :class:`HostCopier`. The
copy threads are one pool per process, created on first use; a copy under
2 MiB stays on the calling thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from replay_proto.dtypes import numpy_view
from replay_proto.scalars import is_int

ENV_THREADS = "REPLAY_FEED_THREADS"
PARALLEL_BYTES = 2 << 20
"""Host copies at least this large are split across threads."""

_MAX_THREADS = 8
_MIN_SPLIT_CORES = 4


def default_threads() -> int:
    """Threads one host copy may use: ``REPLAY_FEED_THREADS``, else from the cores (module docstring).

    Raises:
        ValueError: ``REPLAY_FEED_THREADS`` is set but not an integer >= 1.
    """
    raw = os.environ.get(ENV_THREADS)
    if raw is not None and raw.strip():
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{ENV_THREADS} must be an integer >= 1, got {raw!r}")
        return value
    cores = min(_MAX_THREADS, os.cpu_count() or 1)
    return cores if cores >= _MIN_SPLIT_CORES else 1


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's copy pool, grown (never shrunk) to at least ``workers`` threads."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            old, _pool = _pool, ThreadPoolExecutor(workers, thread_name_prefix="replay-feed-copy")
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


class HostCopier:
    """``dest[:] = src`` for host tensors, split by rows across threads when large.

    numpy releases the GIL while it copies, so a 7 MB pinning copy split four
    ways runs on four cores. The caller copies one part itself and returns
    once every part is done: the copy is synchronous.

    Args:
        threads: threads one copy may use, the caller's included (None: :func:`default_threads`).

    Raises:
        ValueError: ``threads`` is not an integer >= 1.

    Thread-safety: :meth:`copy` may be called from any thread.
    """

    def __init__(self, threads: int | None = None) -> None:
        if threads is None:
            threads = default_threads()
        if not is_int(threads) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads

    def parts(self, nbytes: int, rows: int) -> int:
        """How many threads a copy of ``nbytes`` in ``rows`` rows is split across (1: not split)."""
        if nbytes < PARALLEL_BYTES or rows < 2:
            return 1
        return max(1, min(self.threads, rows, nbytes // (PARALLEL_BYTES // 2)))

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dest`` (same shape and dtype; host memory)."""
        out, inp = numpy_view(dest), numpy_view(src)
        rows = out.shape[0] if out.ndim else 0
        parts = self.parts(out.nbytes, rows)
        if parts < 2:
            np.copyto(out, inp)
            return
        bounds = np.linspace(0, rows, parts + 1).astype(int)
        pool = _executor(self.threads - 1)
        futures = [pool.submit(np.copyto, out[a:b], inp[a:b])
                   for a, b in zip(bounds[1:-1], bounds[2:])]
        try:
            np.copyto(out[: bounds[1]], inp[: bounds[1]])
        finally:
            for future in futures:
                future.result()


_STOP: Any = object()


class DeliveryStage:
    """One thread turning the producer's batches into what the learner receives, in order.

    Args:
        prepare: ``prepare(index, batch)`` -> the item the learner's queue gets
            (runs on the stage thread; an exception ends the stage and is emitted).
        emit: puts an item on the learner's queue.
        name: a name for the thread.

    Items put with :meth:`put` are either ``(index, batch)`` pairs, handed to
    ``prepare``, or markers (the end, a failure), emitted as they are after
    the batches before them; a marker ends the stage. The thread starts with
    the first item, so a feed refused before it produced anything leaves no
    thread behind.

    Thread-safety: :meth:`put` from the producer thread, :meth:`stop` and
    :meth:`join` from any.
    """

    def __init__(self, prepare: Callable[[int, Any], Any], emit: Callable[[Any], None],
                 name: str) -> None:
        self._prepare = prepare
        self._emit = emit
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"replay-deliver-{name}",
                                        daemon=True)
        self._started = False

    def put(self, item: Any) -> None:
        self._queue.put(item)
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self) -> None:
        """Drop what is queued and end the thread (the learner is leaving)."""
        self._stopping.set()
        self._queue.put(_STOP)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end; False if it is still running after ``timeout``."""
        if self._started and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._stopping.is_set():
                continue
            if type(item) is not tuple:
                self._emit(item)
                return
            try:
                ready = self._prepare(*item)
            except BaseException as exc:  # reaches the learner like a failure of the source
                self._emit(exc)
                return
            self._emit(ready)
