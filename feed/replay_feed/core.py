"""A learner's batch feed: background production, bounded prefetch, pinned staging, device copies.

Both learner paths share this machinery: ``replay_client``'s network stream
(gRPC or a same-host shared-memory ring) and ``replay_server``'s embedded
stream (sampling the tables of a server running in the learner's process).
A *source* produces batches on one background thread; the feed turns each
into what the learner receives and hands it over in order.

Per batch:

1. on the producer thread, the source fills a reused set of staging buffers
   (one set per batch in flight or held; pinned when pinning is on; no
   per-batch allocation) or hands over views of a shared-memory slot;
2. on the delivery stage's thread (:mod:`replay_feed.pipeline`; inline on
   the producer thread when batches stay on the host), ``transform`` runs
   on it, if given;
3. pinning applies to exactly what the transform returned: every host
   tensor that is not page-locked is copied into a reused pinned buffer
   (TorchRL's issue #2404 was the opposite: outputs with ``device=None``
   silently skipped); those copies are split across cores
   (:class:`~replay_feed.pipeline.HostCopier`);
4. with a ``device``, the tensors are copied with ``non_blocking=True`` on a
   side stream and an event is recorded after the copy; :class:`FeedStats`
   counts whether each copy read pinned or pageable memory.

A batch whose tensors are all on the delivery's device already (a device
table's, sampled in this process: :mod:`replay_server.engine.storage.device`)
skips steps 3 and 4: no staging, pinning or copy (``FeedStats.resident``).

Steps 2-4 of batch ``k`` overlap step 1 of batch ``k + 1``.

On the learner's thread, ``next()`` makes the current stream wait for that
event (no host wait) and returns the batch, so it never sees a partial copy
while the copy of the next batch overlaps its compute.

Flow control: the feed grants one *credit* per batch the learner asks for
(:mod:`replay_feed.credits`) and the source never produces batch ``k``
unless ``k < window + taken``: at most ``window`` batches (``prefetch``, or
what the stream grew it to) are in flight or buffered beside the one the
learner holds, and memory does not grow. Asking for the next batch gives
the held one back: the learner has *finished* it (or earlier, by
:meth:`FeedCore.ack`), which a leased stream reports to the server (a
queue table's rows). A batch's staging buffers are
reused only once the learner has asked for the batch after it and that batch's
device copy has finished (the credit counts only after its event
completed), so buffers are never overwritten under a pending copy; there
are as many buffer sets as batches in flight or held, never more. Priority
updates the learner hands the stream go in the same queue as its credits,
so they reach the source before the credit that follows them.

Lifetime: batches delivered on the host (``device=None``) are views of the
ring and stay valid until the learner asks for the next one (clone to keep
one longer); batches delivered to a device are fresh device tensors the
learner owns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from replay_feed.credits import CreditFlow, CreditQueue, PriorityUpdate
from replay_feed.delivery import Delivery
from replay_feed.pipeline import DeliveryStage, HostCopier
from replay_feed.tree import tree_leaves
from replay_feed.window import WindowGrowth
from replay_proto.batch import SampleBatch
from replay_proto.scalars import is_int

Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
"""One batch's tensors as ``(dtype, shape)``, in a fixed order."""

_END: Any = object()


class _Slots:
    """Reused buffer sets, one per batch in use; a batch's set goes back to the pool when the
    batch is released, and is reallocated only when a new batch's layout differs.

    Sets in use never exceed the batches in flight or held (the window plus one), so the
    pool grows with the window and no further. Thread-safe.
    """

    def __init__(self, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self._allocate = allocate
        self._lock = threading.Lock()
        self._used: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        self._free: list[tuple[Any, list[torch.Tensor]]] = []

    def get(self, index: int, layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        layout = tuple(layout)
        with self._lock:
            entry = self._used.get(index)
            if entry is None or entry[0] != layout:
                if entry is not None:
                    self._free.append(entry)
                match = next((i for i, e in enumerate(self._free) if e[0] == layout), None)
                entry = self._free.pop(match if match is not None else -1) if self._free else None
                if entry is None or entry[0] != layout:
                    entry = (layout, [self._allocate(shape, dtype) for dtype, shape in layout])
                self._used[index] = entry
            return entry[1]

    def release(self, index: int) -> None:
        with self._lock:
            entry = self._used.pop(index, None)
            if entry is not None:
                self._free.append(entry)

    def clear(self) -> None:
        with self._lock:
            self._used.clear()
            self._free.clear()


# ------------------------------------------------------------------ the feed


class Source(Protocol):
    """What produces a feed's batches on its background thread (most are a
    :class:`~replay_feed.source.LinkSource`: the credit-driven skeleton)."""

    def run(self, feed: FeedCore) -> None:
        """Produce batches with :meth:`FeedCore.deliver` until done; raise on failure."""

    def stop(self) -> None:
        """Unblock :meth:`run` from another thread (it then returns or raises)."""

    def check_update(self, ids: Any, priorities: Any) -> PriorityUpdate:
        """A learner's priority update as flat arrays, checked (raises the entry's typed
        error; ``NotImplementedError`` when the source takes none)."""


@dataclass(slots=True)
class _Ready:
    index: int
    value: Any
    leaves: list[torch.Tensor]
    event: Any
    nbytes: int


@dataclass
class FeedStats:
    """What a feed has done so far (read from the learner's thread)."""

    batches: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    """Seconds the learner spent waiting in ``next()`` for a batch."""
    reconnects: int = 0
    transport: str = "?"
    pinned_copies: int = 0
    """Device copies whose host tensors were all page-locked (asynchronous DMA)."""
    pageable_copies: int = 0
    """Device copies that read pageable host memory (synchronous, slower; should stay 0 when pinned)."""
    resident: int = 0
    """Batches that arrived already on the delivery's device (a device table's, sampled in
    process): handed over with no staging, pinning or copy."""
    notes: list[str] = field(default_factory=list)


class FeedCore:
    """The state a feed's background thread and the learner share.

    Args:
        prefetch: batches in flight or buffered ahead of the learner (>= 1).
        delivery: device and pinning (:func:`~replay_feed.delivery.resolve_delivery`).
        transform: applied to each batch before pinning and the device copy.
        threads: threads one host copy may use (None: sized from the cores,
            :func:`~replay_feed.pipeline.default_threads`).
        pipelined: run transform, pinning and the device copy on the delivery
            stage's thread (None: when batches are copied to a device; see
            :mod:`replay_feed.pipeline`).

    Thread-safety: :meth:`staging`, :meth:`deliver` and :meth:`fail` are for the
    producer thread; :meth:`take` for the learner's; queues carry everything between them.
    """

    def __init__(self, prefetch: int, delivery: Delivery,
                 transform: Callable[[SampleBatch], Any] | None = None, *,
                 threads: int | None = None, pipelined: bool | None = None) -> None:
        if not is_int(prefetch) or prefetch < 1:
            raise ValueError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {type(transform).__name__}")
        self.prefetch = prefetch
        self.delivery = delivery
        self.transform = transform
        self.stats = FeedStats()
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.credits = CreditQueue(self._release)
        """Credits (one per batch the learner gave back) and priority updates, in order."""
        self.stopping = self.credits.stopping
        accel = delivery.accelerator
        pinned = delivery.pin and accel is not None
        self._staging = _Slots(accel.pinned_empty if pinned else _host_empty)  # type: ignore[union-attr]
        self._pinned_out = _Slots(accel.pinned_empty if pinned else _host_empty)  # type: ignore[union-attr]
        self._held: _Ready | None = None
        self._acked = False           # the held batch was finished by ack()
        self._credited_first = False  # the first take granted its credit
        self._taken = 0
        self._finished = False  # finish() queued the end (once: a source may end it early)
        self._flow: CreditFlow | None = None
        self._on_release: dict[int, Callable[[], None]] = {}
        self._on_given_back: dict[int, Callable[[], None]] = {}
        self._growth: WindowGrowth | None = None
        self._copier = HostCopier(threads)
        if pipelined is None:
            pipelined = delivery.device is not None
        self._stage = DeliveryStage(self._prepare, self._ready.put, "feed") if pipelined else None
        if pipelined:
            threads = self._copier.threads
            self.stats.notes.append(
                f"pipelined: transform, pinning and device copy on their own thread; large "
                f"host copies on {threads} thread{'s' if threads > 1 else ''}")

    # ------------------------------------------------------------ producer side

    def staging(self, index: int, layout: Layout) -> list[torch.Tensor]:
        """The reused staging buffers of batch ``index``, in ``layout`` order (pinned when
        pinning is on); they are the batch's until the learner gives it back."""
        return self._staging.get(index, layout)

    def flow(self) -> CreditFlow:
        """The learner's credits as a link forwards them, over a window of ``prefetch``
        (grown later by :meth:`grow_window`'s rule, if set)."""
        if self._flow is None:
            self._flow = CreditFlow(self.credits, self.prefetch)
        return self._flow

    @property
    def window(self) -> int:
        """The learner's window now (``prefetch`` until a link widened it)."""
        return self.prefetch if self._flow is None else self._flow.window

    def grow_window(self, budget_bytes: float, may_grow: Callable[[], bool]) -> None:
        """Let the window grow while the learner starves (:mod:`replay_feed.window`)."""
        self._growth = WindowGrowth(
            self.flow(), budget_bytes,
            lambda: self.stats.bytes / self.stats.batches if self.stats.batches else None,
            may_grow, self.stats.notes.append)

    def copy_rows(self, dest: torch.Tensor, start: int, src: torch.Tensor) -> None:
        """``dest[start : start + len(src)] = src`` on host memory, split across cores when large.

        For sources that decode into :meth:`staging` (e.g. a network stream).
        """
        self._copier.copy(dest[start : start + src.shape[0]], src)

    def deliver(self, index: int, batch: SampleBatch) -> None:
        """Transform, pin and copy batch ``index`` per the delivery, then queue it for the learner.

        Pipelined, the work happens on the delivery stage's thread and this returns at once.
        """
        if self._stage is not None:
            self._stage.put((index, batch))
        else:
            self._ready.put(self._prepare(index, batch))

    def _prepare(self, index: int, batch: SampleBatch) -> _Ready:
        value = self.transform(batch) if self.transform is not None else batch
        leaves, rebuild = tree_leaves(value)
        delivery, accel = self.delivery, self.delivery.accelerator
        if delivery.device is not None and leaves and _all_on(leaves, delivery.device):
            # Already where the learner wants it: nothing to copy. The learner's stream
            # still waits for the work that made it (the gather, on the producer's stream).
            self.stats.resident += 1
            event = accel.record(delivery.device) if accel is not None else None
            return _Ready(index, value, leaves, event,
                          sum(t.numel() * t.element_size() for t in leaves))
        changed = False
        if delivery.pin and accel is not None:
            host = [(i, t) for i, t in enumerate(leaves)
                    if t.device.type == "cpu" and not accel.is_pinned(t)]
            if host:
                pinned = self._pinned_out.get(index, [(t.dtype, tuple(t.shape)) for _, t in host])
                for (i, t), dest in zip(host, pinned):
                    self._copier.copy(dest, t.detach())
                    leaves[i] = dest
                changed = True
        event = None
        if delivery.device is not None and accel is not None and leaves:
            if all(accel.is_pinned(t) for t in leaves if t.device.type == "cpu"):
                self.stats.pinned_copies += 1
            else:
                self.stats.pageable_copies += 1
            leaves, event = accel.copy(leaves, delivery.device)
            changed = True
        if changed:
            value = rebuild(leaves)
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        return _Ready(index, value, leaves, event, nbytes)

    def fail(self, exc: BaseException) -> None:
        """End the feed with ``exc``, raised to the learner after the batches before it."""
        (self._stage or self._ready).put(exc)

    def finish(self) -> None:
        """End the feed normally (the learner's loop stops after the queued batches); the
        producer's thread only, idempotent."""
        if self._finished:
            return
        self._finished = True
        (self._stage or self._ready).put(_END)

    def _release(self, token: Any) -> None:
        """A batch the learner gave back (``token``: its index and copy event): once its
        device copy has finished, its buffers may be reused. On the credits' reader thread."""
        if token is None:
            return
        index, event = token
        if event is not None and self.delivery.accelerator is not None:
            self.delivery.accelerator.synchronize(event)
        self._staging.release(index)
        self._pinned_out.release(index)
        hook = self._on_release.pop(index, None)
        if hook is not None:
            hook()

    def when_released(self, index: int, hook: Callable[[], None]) -> None:
        """Call ``hook`` once the learner gave batch ``index`` back and its device copy is done
        (for a source that lent the learner memory of its own: a shared-memory chunk).
        Producer thread; the hook runs on the credits' reader thread."""
        self._on_release[index] = hook

    def when_given_back(self, index: int, hook: Callable[[], None]) -> None:
        """Call ``hook`` on the learner's thread when it gives batch ``index`` back (asks for
        the next), before that credit is sent: a source that lent the learner device memory
        records there, on the learner's current stream, that its work on it is issued (CUDA
        IPC's *released* event). Producer thread; dropped with the batch if never given back."""
        self._on_given_back[index] = hook

    def update_priorities(self, update: PriorityUpdate) -> None:
        """Queue ``update`` to go before the next credit (learner's thread)."""
        self.credits.update(update)

    # ------------------------------------------------------------ learner side

    def take(self) -> Any:
        """The next batch (blocking); raises the producer's error, or StopIteration at the end.

        Asking for it finishes the batch held (unless :meth:`ack` did): its
        buffers may be reused, and a leased stream acknowledges its rows.
        """
        held, self._held = self._held, None
        if held is not None or not self._credited_first:
            # Give back the previous batch (finished now): its buffers are reusable once its
            # copy is done. The first take grants the credit of the batch it will hold.
            self._credited_first = True
            finished = held is not None and not self._acked
            given_back = None if held is None else self._on_given_back.pop(held.index, None)
            if given_back is not None:
                given_back()
            self.credits.credit(None if held is None else (held.index, held.event), finished)
        self._acked = False
        start = time.perf_counter()
        item = self._ready.get()
        waited = time.perf_counter() - start
        self.stats.wait_s += waited
        if item is _END:
            self._ready.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            self._ready.put(item)
            raise item
        self._held = item
        self._taken += 1
        if item.event is not None and self.delivery.accelerator is not None:
            self.delivery.accelerator.consume(item.leaves, item.event)
        self.stats.batches += 1
        self.stats.bytes += item.nbytes
        if self._growth is not None:
            self._growth.took(waited)
        return item.value

    def ack(self) -> bool:
        """The learner finished the batch it holds, before asking for the next: a leased
        stream acknowledges its rows now (with the next message). Whether one was held."""
        if self._held is None or self._acked:
            return False
        self._acked = True
        self.credits.finish()
        return True

    def holds_unfinished(self) -> bool:
        """Whether the learner holds a batch it has not finished (taken, not acknowledged)."""
        return self._held is not None and not self._acked

    @property
    def taken(self) -> int:
        return self._taken

    def stop(self) -> None:
        """Wake the producer and the learner so both can end."""
        self.credits.stop()
        if self._stage is not None:
            self._stage.stop()
        self._ready.put(_END)

    def release(self, timeout: float = 10.0) -> None:
        """Drop buffers and queued batches (after the producer has ended and :meth:`stop`).

        Waits up to ``timeout`` for the delivery stage to leave the buffers alone.
        """
        if self._stage is not None:
            self._stage.join(timeout)
        self._held = None
        self._on_given_back.clear()
        self._staging.clear()
        self._pinned_out.clear()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._ready.put(_END)


def _all_on(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether every tensor is on ``device`` (``"cuda"`` without an index: the current one)."""
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return all(t.device.type == device.type and t.device.index == index for t in tensors)


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)
