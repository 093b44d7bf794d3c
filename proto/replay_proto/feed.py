"""A learner's batch feed: background production, bounded prefetch, pinned staging, device copies.

Both learner paths share this machinery: ``replay_client``'s network stream
(gRPC or a same-host shared-memory ring) and ``replay_server``'s embedded
stream (sampling the tables of a server running in the learner's process).
A *source* produces batches on one background thread; the feed turns each
into what the learner receives and hands it over in order.

Per batch, on the background thread:

1. the source fills slot ``k % slots`` of a reused ring of staging buffers
   (``slots = prefetch + 1``; pinned when pinning is on; no per-batch
   allocation) or hands over views of a shared-memory slot;
2. ``transform`` runs on it, if given;
3. pinning applies to exactly what the transform returned: every host
   tensor that is not page-locked is copied into a reused pinned buffer
   (TorchRL's issue #2404 was the opposite: outputs with ``device=None``
   silently skipped);
4. with a ``device``, the tensors are copied with ``non_blocking=True`` on a
   side stream and an event is recorded after the copy.

On the learner's thread, ``next()`` makes the current stream wait for that
event (no host wait) and returns the batch, so it never sees a partial copy
while the copy of the next batch overlaps its compute.

Flow control: the feed grants one *credit* per batch the learner takes and
the source never produces batch ``k`` unless ``k < prefetch + taken``: at most
``prefetch`` batches are in flight or buffered beside the one the learner
holds, and memory does not grow. A slot is reused only once the learner has
taken the batch after it and that batch's device copy has finished (the
credit is granted only after its event completed), so buffers are never
overwritten under a pending copy.

Lifetime: batches delivered on the host (``device=None``) are views of the
ring and stay valid until the learner asks for the next one (clone to keep
one longer); batches delivered to a device are fresh device tensors the
learner owns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from replay_proto.accel import Accelerator, detect_accelerator
from replay_proto.batch import SampleBatch
from replay_proto.codec import copy_rows
from replay_proto.keys import flatten, unflatten

log = logging.getLogger("replay.feed")

Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
"""A batch's flat tensors as (key, dtype, full shape), in a fixed order."""

_DETECT: Any = object()
_END: Any = object()
_STOP: Any = object()
_WAKE: Any = object()


# ------------------------------------------------------------------ delivery


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where batches go and whether they are pinned, decided once per feed.

    Attributes:
        device: the device batches are copied to (None: they stay on the host).
        pin: whether what the learner receives (or the device copy reads) is page-locked.
        accelerator: the accelerator doing pinning and copies (None: none present).
        note: one line saying what was decided and why (``pin_memory="auto"`` reports here).
    """

    device: torch.device | None
    pin: bool
    accelerator: Accelerator | None
    note: str


def resolve_delivery(device: Any, pin_memory: bool | str, accelerator: Any = _DETECT) -> Delivery:
    """Check ``device`` and ``pin_memory`` against the accelerator this process has.

    Raises:
        ValueError: ``pin_memory`` is not True, False or "auto"; ``pin_memory=True``
            or a non-CPU ``device`` without a matching accelerator (the message
            says what is missing, never a silent no-op).
    """
    accel = detect_accelerator() if accelerator is _DETECT else accelerator
    if not (isinstance(pin_memory, bool) or pin_memory == "auto"):
        raise ValueError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")
    try:
        target = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if target is not None and target.type == "cpu":
        target = None
    if target is not None and (accel is None or target.type != accel.device_type):
        have = "no accelerator" if accel is None else f"only {accel.device_type}"
        raise ValueError(f"device={device!r} but this process has {have} "
                         f"(torch.cuda.is_available() is {torch.cuda.is_available()})")
    if pin_memory is True and accel is None:
        raise ValueError("pin_memory=True needs an accelerator and this process has none "
                         "(torch.cuda.is_available() is False); pinned memory would help no "
                         "copy: use pin_memory='auto' or False")
    pin = accel is not None if pin_memory == "auto" else bool(pin_memory)
    if pin:
        note = f"batches pinned for {accel.device_type if accel else '?'}"
    elif accel is None:
        note = "batches not pinned: no accelerator in this process"
    else:
        note = "batches not pinned (pin_memory=False)"
        if target is not None:
            note += ": device copies are synchronous"
    if target is not None:
        note += f"; copied to {target} on a side stream"
    return Delivery(target, pin, accel, note)


# ------------------------------------------------------------------ structure


def tree_leaves(value: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors in ``value`` and a function rebuilding ``value`` around replacements.

    Understands SampleBatch, TensorDict (by duck typing), mappings, lists,
    tuples and tensors; anything else is kept as it is.
    """
    if isinstance(value, torch.Tensor):
        return [value], lambda ts: ts[0]
    if isinstance(value, SampleBatch):
        flat = flatten(value.data)
        keys = list(flat)
        leaves = [flat[k] for k in keys] + [value.ids, value.weights, value.probabilities]

        def rebuild_batch(ts: list[torch.Tensor]) -> SampleBatch:
            n = len(keys)
            return SampleBatch(unflatten(dict(zip(keys, ts[:n]))), ts[n], ts[n + 1], ts[n + 2])

        return leaves, rebuild_batch
    if hasattr(value, "batch_size") and hasattr(value, "keys") and hasattr(value, "set"):
        keys = list(value.keys(include_nested=True, leaves_only=True))
        leaves = [value.get(k) for k in keys]
        cls, batch_size = type(value), value.batch_size

        def rebuild_td(ts: list[torch.Tensor]) -> Any:
            devices = {t.device for t in ts}
            out = cls({}, batch_size=batch_size, device=devices.pop() if len(devices) == 1 else None)
            for key, tensor in zip(keys, ts):
                out.set(key, tensor)
            return out

        return leaves, rebuild_td
    if isinstance(value, Mapping):
        parts = {k: tree_leaves(v) for k, v in value.items()}
        return _combine(list(parts.values()), lambda vs: dict(zip(parts, vs)))
    if isinstance(value, (list, tuple)):
        parts_seq = [tree_leaves(v) for v in value]
        kind = type(value)
        return _combine(parts_seq, lambda vs: kind(vs) if kind in (list, tuple) else kind(*vs))
    return [], lambda ts: value


def _combine(parts: list[tuple[list[torch.Tensor], Callable]], build: Callable[[list[Any]], Any]):  # type: ignore[no-untyped-def]
    leaves: list[torch.Tensor] = []
    spans = []
    for sub, rebuild in parts:
        spans.append((len(leaves), len(leaves) + len(sub), rebuild))
        leaves.extend(sub)
    return leaves, lambda ts: build([rebuild(ts[a:b]) for a, b, rebuild in spans])


class _Ring:
    """``slots`` sets of reused buffers, reallocated only when a slot's layout changes."""

    def __init__(self, slots: int, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self._buffers: list[list[torch.Tensor] | None] = [None] * slots
        self._layouts: list[Any] = [None] * slots
        self._allocate = allocate

    def get(self, index: int, layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        i = index % len(self._buffers)
        layout = tuple(layout)
        if self._layouts[i] != layout:
            self._buffers[i] = [self._allocate(shape, dtype) for dtype, shape in layout]
            self._layouts[i] = layout
        buffers = self._buffers[i]
        assert buffers is not None
        return buffers

    def clear(self) -> None:
        self._buffers = [None] * len(self._buffers)
        self._layouts = [None] * len(self._layouts)


# ------------------------------------------------------------------ the feed


class Source(Protocol):
    """What produces a feed's batches on its background thread."""

    def run(self, feed: FeedCore) -> None:
        """Produce batches with :meth:`FeedCore.deliver` until done; raise on failure."""

    def stop(self) -> None:
        """Unblock :meth:`run` from another thread (it then returns or raises)."""


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
    notes: list[str] = field(default_factory=list)


class FeedCore:
    """The state a feed's background thread and the learner share.

    Thread-safety: :meth:`staging`, :meth:`deliver`, :meth:`fail` and
    :meth:`wait_credits` are for the producer thread; :meth:`take` for the
    learner's; queues carry everything between them.
    """

    def __init__(self, prefetch: int, delivery: Delivery,
                 transform: Callable[[SampleBatch], Any] | None = None) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {type(transform).__name__}")
        self.prefetch = prefetch
        self.slots = prefetch + 1
        self.delivery = delivery
        self.transform = transform
        self.stopping = threading.Event()
        self.stats = FeedStats()
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._credits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        accel = delivery.accelerator
        pinned = delivery.pin and accel is not None
        self._staging = _Ring(self.slots, accel.pinned_empty if pinned else _host_empty)  # type: ignore[union-attr]
        self._pinned_out = _Ring(self.slots, accel.pinned_empty if pinned else _host_empty)  # type: ignore[union-attr]
        self._held: _Ready | None = None
        self._taken = 0

    # ------------------------------------------------------------ producer side

    def staging(self, index: int, layout: Layout) -> dict[str, torch.Tensor]:
        """The reused staging buffers of batch ``index`` (pinned when pinning is on)."""
        buffers = self._staging.get(index, [(dtype, shape) for _, dtype, shape in layout])
        return {key: buf for (key, _, _), buf in zip(layout, buffers)}

    def deliver(self, index: int, batch: SampleBatch) -> None:
        """Transform, pin and copy batch ``index`` per the delivery, then queue it for the learner."""
        value = self.transform(batch) if self.transform is not None else batch
        leaves, rebuild = tree_leaves(value)
        delivery, accel = self.delivery, self.delivery.accelerator
        changed = False
        if delivery.pin and accel is not None:
            host = [(i, t) for i, t in enumerate(leaves)
                    if t.device.type == "cpu" and not accel.is_pinned(t)]
            if host:
                pinned = self._pinned_out.get(index, [(t.dtype, tuple(t.shape)) for _, t in host])
                for (i, t), dest in zip(host, pinned):
                    copy_rows(dest, 0, t.detach())
                    leaves[i] = dest
                changed = True
        event = None
        if delivery.device is not None and accel is not None and leaves:
            leaves, event = accel.copy(leaves, delivery.device)
            changed = True
        if changed:
            value = rebuild(leaves)
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        self._ready.put(_Ready(index, value, leaves, event, nbytes))

    def fail(self, exc: BaseException) -> None:
        """End the feed with ``exc``, raised to the learner after the batches before it."""
        self._ready.put(exc)

    def finish(self) -> None:
        """End the feed normally (the learner's loop stops after the queued batches)."""
        self._ready.put(_END)

    def wait_credits(self) -> int:
        """Block until the learner has taken more batches; return how many (0: woken for nothing).

        Each credit is granted only after the device copy of the batch the
        learner gave back has finished, so its slot may be overwritten. Check
        :attr:`stopping` after a return of 0.
        """
        items = [self._credits.get()]
        while True:
            try:
                items.append(self._credits.get_nowait())
            except queue.Empty:
                break
        count = 0
        for item in items:
            if item is _STOP:
                self._credits.put(_STOP)  # every waiter must see it
                continue
            if item is _WAKE:
                continue
            if item is not None and self.delivery.accelerator is not None:
                self.delivery.accelerator.synchronize(item)
            count += 1
        return count

    def return_credits(self, count: int) -> None:
        """Give back credits taken by :meth:`wait_credits` but not used."""
        for _ in range(count):
            self._credits.put(None)

    def wake(self) -> None:
        """Make a :meth:`wait_credits` call return (with 0 if no credit came)."""
        self._credits.put(_WAKE)

    # ------------------------------------------------------------ learner side

    def take(self) -> Any:
        """The next batch (blocking); raises the producer's error, or StopIteration at the end."""
        held, self._held = self._held, None
        start = time.perf_counter()
        item = self._ready.get()
        self.stats.wait_s += time.perf_counter() - start
        if item is _END:
            self._ready.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            self._ready.put(item)
            raise item
        # Give back the previous batch: its slot is reusable once its copy is done.
        self._credits.put(None if held is None else held.event)
        self._held = item
        self._taken += 1
        if item.event is not None and self.delivery.accelerator is not None:
            self.delivery.accelerator.consume(item.leaves, item.event)
        self.stats.batches += 1
        self.stats.bytes += item.nbytes
        return item.value

    @property
    def taken(self) -> int:
        return self._taken

    def stop(self) -> None:
        """Wake the producer and the learner so both can end."""
        self.stopping.set()
        self._credits.put(_STOP)
        self._ready.put(_END)

    def release(self) -> None:
        """Drop buffers and queued batches (after the producer has ended)."""
        self._held = None
        self._staging.clear()
        self._pinned_out.clear()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._ready.put(_END)


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class BatchStream:
    """The learner's iterator over a feed: ``for batch in stream: ...``.

    Breaking out of the loop, leaving a ``with`` block, :meth:`close` or
    garbage collection stops the background thread, cancels the source and
    releases its buffers (shared memory included). Errors of the source
    reach the learner as the exceptions the source raised, after the
    batches that came before them.

    Attributes:
        stats: batches and bytes delivered, time waited, transport, notes.
    """

    def __init__(self, core: FeedCore, source: Source, name: str) -> None:
        self._core = core
        self._source = source
        self._name = name
        self.stats = core.stats
        self.stats.notes.append(core.delivery.note)
        self._thread = threading.Thread(
            target=_produce, args=(core, source), name=f"replay-stream-{name}", daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def delivery(self) -> Delivery:
        """What was decided about device and pinning."""
        return self._core.delivery

    @property
    def pinned(self) -> bool:
        """Whether batches (or the host side of their device copies) are page-locked."""
        return self._core.delivery.pin

    @property
    def transport(self) -> str:
        """How batches travel: ``shared_memory``, ``grpc`` or ``in_process``."""
        return self.stats.transport

    def __iter__(self):  # type: ignore[no-untyped-def]
        try:
            while True:
                yield self.__next__()
        except StopIteration:
            return
        finally:
            self.close()

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            batch = self._core.take()
            if self.stats.batches == 1:
                log.info("stream %s: %s (%s)", self._name, self.stats.transport,
                         "; ".join(self.stats.notes))
            return batch
        except StopIteration:
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Stop the background work and release buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._core.stop()
        self._source.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("stream thread %s did not stop within %.0f s", self._thread.name, timeout)
        self._core.release()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=2.0)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _produce(core: FeedCore, source: Source) -> None:
    try:
        source.run(core)
    except BaseException as exc:
        if core.stopping.is_set():
            core.finish()
        else:
            core.fail(exc)
    else:
        core.finish()
