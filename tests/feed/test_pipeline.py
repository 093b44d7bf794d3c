"""The feed's pipeline without a GPU: the delivery stage's order, overlap and buffer reuse.

A simulated accelerator (:class:`GuardedAccelerator`) lands each device copy
later, on another thread, and keeps the source buffers of every copy still
in flight; the source checks, before each write into a staging slot, that no
copy is still reading it. The real CUDA path is tested in tests/gpu.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from replay_feed import BatchStream, FeedCore, HostCopier, default_threads, resolve_delivery
from replay_feed.pipeline import ENV_THREADS
from tests.conftest import stays, wait_for
from tests.feed.test_core import RowSource, SlowAccelerator


class GuardedAccelerator(SlowAccelerator):
    """Copies land after a random delay; :meth:`reading` says whether one still reads a buffer.

    Like CUDA, :meth:`consume` does not wait on the host: the learner's
    device work is queued behind the copy while its host thread goes on,
    takes the next batch and gives this one back.
    """

    def __init__(self, max_delay: float = 0.004) -> None:
        super().__init__()
        self.max_delay = max_delay
        self._rng = random.Random(7)
        self._lock = threading.Lock()
        self._in_flight: dict[int, list[tuple[int, int]]] = {}
        self._next = 0
        self.consumed: list[threading.Event] = []

    def issued(self, tensors):
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._in_flight[key] = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
            delay = self._rng.uniform(0, self.max_delay)

        def landed():
            with self._lock:
                del self._in_flight[key]

        return delay, landed

    def consume(self, tensors, event):
        self.waits += 1
        self.consumed.append(event)

    def reading(self, tensor: torch.Tensor) -> bool:
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(s < end and start < s + n for spans in self._in_flight.values()
                       for s, n in spans)


class GuardedSource(RowSource):
    """A :class:`RowSource` that records every write into a buffer a device copy still reads."""

    def __init__(self, accel: GuardedAccelerator, **kwargs) -> None:
        super().__init__(**kwargs)
        self.accel = accel
        self.violations: list[int] = []

    def run(self, core: FeedCore) -> None:
        staging = core.staging

        def checked(index, layout):
            buffers = staging(index, layout)
            if any(self.accel.reading(b) for b in buffers):
                self.violations.append(index)
            return buffers

        core.staging = checked  # type: ignore[method-assign]
        super().run(core)


def _stream(source, accel, *, prefetch=2, transform=None, device="meta", pipelined=None):
    core = FeedCore(prefetch, resolve_delivery(device, "auto", accelerator=accel), transform,
                    pipelined=pipelined)
    return BatchStream(core, source, "t")


@pytest.mark.parametrize("prefetch", [1, 3])
def test_a_staging_slot_is_never_rewritten_while_its_device_copy_runs(prefetch):
    accel = GuardedAccelerator()
    source = GuardedSource(accel, num_batches=60)
    batches = list(_stream(source, accel, prefetch=prefetch))  # the host never waits
    assert source.violations == []
    for event in accel.consumed:  # the device work behind each batch's copy
        assert event.wait(10)
    rows = []
    for batch in batches:
        assert torch.equal(batch.data["row"], batch.ids)
        assert torch.equal(batch.data["obs"][:, -1], batch.ids.float())
        rows.append(int(batch.ids[0]))
    assert rows == [k * 16 for k in range(60)]  # every batch, in order
    assert accel.copies == 60


def test_the_source_gathers_the_next_batch_while_this_one_is_delivered():
    # The transform of batch k waits until the source has gathered batch k + 1:
    # only a pipelined feed gets past it (inline, the source would be waiting on the transform).
    source = RowSource(num_batches=6)
    seen = []

    def transform(batch):
        k = int(batch.ids[0]) // 16
        assert wait_for(lambda: source.produced >= min(k + 2, 6), timeout=10), \
            f"batch {k + 1} was not gathered while batch {k} was delivered"
        seen.append(k)
        return batch

    for _ in _stream(source, SlowAccelerator(), transform=transform):
        pass
    assert seen == list(range(6))


def test_a_failure_reaches_the_learner_after_the_batches_before_it_through_the_stage():
    fail = threading.Event()
    stream = _stream(RowSource(num_batches=0, fail=fail), SlowAccelerator(), prefetch=1)
    first = next(stream)
    assert int(first.ids[0]) == 0
    fail.set()
    with pytest.raises(LookupError, match="the source failed"):
        for _ in range(5):
            next(stream)
    with pytest.raises(StopIteration):
        next(stream)


def test_a_failing_transform_ends_the_stream_with_its_error():
    def transform(batch):
        if int(batch.ids[0]) == 32:
            raise ArithmeticError("bad batch 2")
        return batch

    received = []
    with pytest.raises(ArithmeticError, match="bad batch 2"):
        for batch in _stream(RowSource(num_batches=10), SlowAccelerator(), transform=transform):
            received.append(int(batch.ids[0]))
    assert received == [0, 16]


def test_copies_are_counted_as_pinned_or_pageable():
    accel = SlowAccelerator()
    stream = _stream(RowSource(num_batches=4), accel)
    for _ in stream:
        assert stream.stats.pinned_copies >= stream.stats.batches  # while the stream is live
    assert stream.stats.pinned_copies == 4 and stream.stats.pageable_copies == 0

    class Unchecked(SlowAccelerator):
        def copy(self, tensors, device):  # pageable copies are allowed with pin_memory=False
            done = threading.Event()
            done.set()
            return [t.clone() for t in tensors], done

        def consume(self, tensors, event):
            pass

    core = FeedCore(2, resolve_delivery("meta", False, accelerator=Unchecked()))
    unpinned = BatchStream(core, RowSource(num_batches=3), "u")
    assert len(list(unpinned)) == 3
    assert unpinned.stats.pageable_copies == 3 and unpinned.stats.pinned_copies == 0


def test_host_batches_are_transformed_on_the_producer_thread_without_a_stage():
    threads = []

    def transform(batch):
        threads.append(threading.current_thread().name)
        return batch

    stream = _stream(RowSource(num_batches=2), None, device=None, transform=transform)
    assert not any("pipelined" in note for note in stream.stats.notes)
    assert len(list(stream)) == 2 and threads == ["replay-stream-t"] * 2


def test_a_feed_that_never_produced_leaves_no_stage_thread():
    before = threading.active_count()
    FeedCore(2, resolve_delivery("meta", "auto", accelerator=SlowAccelerator()), pipelined=True)
    assert threading.active_count() == before


def test_closing_a_pipelined_stream_ends_its_threads():
    stream = _stream(RowSource(num_batches=0), SlowAccelerator())
    next(stream)
    stream.close()
    assert wait_for(lambda: not [t for t in threading.enumerate()
                                 if t.name in ("replay-stream-t", "replay-deliver-feed")])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_a_split_host_copy_equals_a_plain_copy(dtype):
    src = torch.arange(600 * 4096, dtype=torch.float32).view(600, 4096).to(dtype)
    dest = torch.zeros_like(src)
    copier = HostCopier(4)
    assert copier.parts(src.numel() * src.element_size(), 600) > 1
    copier.copy(dest, src)
    assert torch.equal(dest, src)
    small = torch.arange(10)
    out = torch.zeros_like(small)
    HostCopier(4).copy(out, small)
    assert torch.equal(out, small) and copier.parts(80, 10) == 1


def test_a_feed_copies_rows_at_an_offset_split_across_threads():
    core = FeedCore(2, resolve_delivery(None, False, accelerator=None), threads=3)
    dest = torch.zeros(1000, 4096, dtype=torch.uint8)
    src = torch.randint(0, 255, (700, 4096), dtype=torch.uint8)
    core.copy_rows(dest, 200, src)
    assert torch.equal(dest[200:900], src)
    assert not dest[:200].any() and not dest[900:].any()


def test_a_split_copy_reads_non_contiguous_sources():
    src = torch.arange(512 * 2048, dtype=torch.float32).view(2048, 512).t()
    dest = torch.empty(512, 2048)
    HostCopier(3).copy(dest, src)
    assert np.array_equal(dest.numpy(), src.numpy())


def test_thread_counts_come_from_the_cores_unless_overridden(monkeypatch):
    monkeypatch.delenv(ENV_THREADS, raising=False)
    for cores, threads in ((1, 1), (2, 1), (3, 1), (4, 4), (16, 8), (None, 1)):
        monkeypatch.setattr("replay_feed.pipeline.os.cpu_count", lambda cores=cores: cores)
        assert default_threads() == threads, cores
    monkeypatch.setenv(ENV_THREADS, "3")
    assert default_threads() == 3 and HostCopier().threads == 3
    monkeypatch.setenv(ENV_THREADS, "zero")
    with pytest.raises(ValueError, match="REPLAY_FEED_THREADS must be an integer >= 1, got 'zero'"):
        default_threads()
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        HostCopier(0)


def test_the_producer_stays_within_prefetch_when_pipelined():
    source = RowSource(num_batches=0)
    stream = _stream(source, SlowAccelerator(delay=0.0), prefetch=3,
                     transform=lambda b: b)
    with stream:
        for _ in range(5):
            next(stream)
        assert wait_for(lambda: source.produced >= 8)
        assert stays(lambda: source.produced == 8)  # 5 taken + 3 ahead

