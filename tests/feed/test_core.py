"""The learner's feed on a machine without a GPU, with a simulated accelerator.

CUDA cannot run here, so :class:`SlowAccelerator` stands in for it: pinned
buffers are remembered by address, and a device copy really happens later,
on another thread, like a DMA on a side stream. If the feed reused a staging
buffer before its copy finished, or handed the learner a copy in progress,
the data would come out wrong and these tests would fail. The real CUDA path
is tested in tests/gpu.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from replay_feed import BatchStream, FeedCore, resolve_delivery, tree_leaves
from replay_proto.batch import SampleBatch
from tests.conftest import stays, wait_for


def wait_credits(core: FeedCore) -> int:
    """Block until the learner has taken more batches; how many (0: woken for nothing). For
    test sources that count credits themselves (updates queued meanwhile are dropped)."""
    grant = core.credits.take()
    return 0 if grant is None else grant.credits


class SlowAccelerator:
    """Asynchronous copies that land ``delay`` seconds after they are issued."""

    device_type = "meta"

    def __init__(self, delay: float = 0.003) -> None:
        self.delay = delay
        self.pinned: list[tuple[int, int]] = []
        self.registered: list[torch.Tensor] = []
        self.copies = 0
        self.waits = 0

    def pinned_empty(self, shape, dtype):
        tensor = torch.empty(tuple(shape), dtype=dtype)
        self.pinned.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return tensor

    def is_pinned(self, tensor):
        ptr = tensor.data_ptr()
        return any(start <= ptr < start + size or (size == 0 and ptr == start) for start, size in self.pinned)

    def register(self, tensor):
        return False

    def unregister(self, tensor):
        pass

    def issued(self, tensors):
        """Called as a copy is issued: its delay, and what to call once it has landed."""
        return self.delay, lambda: None

    def copy(self, tensors, device):
        assert all(self.is_pinned(t) for t in tensors), "a device copy from unpinned memory"
        out = [torch.full_like(t, 0) for t in tensors]
        done = threading.Event()
        delay, landed = self.issued(tensors)

        def land():
            time.sleep(delay)
            for dest, src in zip(out, tensors):
                dest.copy_(src)
            landed()
            done.set()

        threading.Thread(target=land, daemon=True).start()
        self.copies += 1
        return out, done

    def consume(self, tensors, event):
        self.waits += 1
        event.wait()

    def synchronize(self, event):
        event.wait()


class RowSource:
    """A feed's source without a server: batch k holds rows ``k * batch_size ...``, gathered
    into the feed's reused staging buffers as a table's sample would be.

    ``fail`` (an event): once set, the next batch raises instead.
    """

    def __init__(self, batch_size: int = 16, num_batches: int = 40,
                 fail: threading.Event | None = None) -> None:
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.fail = fail
        self.produced = 0
        self._stopped = threading.Event()

    def run(self, core: FeedCore) -> None:
        size, credits, index = self.batch_size, core.prefetch, 0
        layout = ((torch.int64, (size,)), (torch.float32, (size, 64)))
        while not self._stopped.is_set() and (not self.num_batches or index < self.num_batches):
            while credits == 0:
                credits += wait_credits(core)
                if core.stopping.is_set():
                    return
            if self.fail is not None and self.fail.is_set():
                raise LookupError("the source failed")
            row, obs = core.staging(index, layout)
            rows = torch.arange(index * size, (index + 1) * size)
            row.copy_(rows)
            obs.copy_(rows.float().view(-1, 1).expand(size, 64))
            self.produced += 1
            core.deliver(index, SampleBatch.from_columns(
                {"row": row, "obs": obs}, rows, torch.ones(size),
                torch.full((size,), 1 / size, dtype=torch.float64)))
            index += 1
            credits -= 1

    def stop(self) -> None:
        self._stopped.set()


def _stream(source, accel, *, prefetch=2, transform=None, pin_memory="auto", device="meta"):
    delivery = resolve_delivery(device, pin_memory, accelerator=accel)
    core = FeedCore(prefetch, delivery, transform)
    return BatchStream(core, source, "t")


def test_device_batches_are_complete_and_in_order_despite_slow_copies():
    accel = SlowAccelerator()
    count = 0
    for batch in _stream(RowSource(), accel):
        # The learner only sees a batch once its copy has landed.
        assert torch.equal(batch.data["row"], batch.ids)
        assert torch.equal(batch.data["obs"][:, 5], batch.ids.float())
        count += 1
    assert count == 40 and accel.copies == 40 and accel.waits == 40


def test_what_the_learner_keeps_stays_valid_on_the_device_path():
    kept = [batch for batch in _stream(RowSource(num_batches=10), SlowAccelerator())]
    for batch in kept:  # device batches are fresh tensors, never reused
        assert torch.equal(batch.data["row"], batch.ids)


def test_staging_is_pinned_and_copies_read_only_pinned_memory():
    accel = SlowAccelerator()
    stream = _stream(RowSource(num_batches=5), accel, device=None)
    for batch in stream:
        assert all(accel.is_pinned(t) for t in tree_leaves(batch)[0])
    assert stream.pinned


def test_pinning_applies_to_the_transform_output():
    # A transform building new tensors (TorchRL's #2404 lost pinning exactly here).
    accel = SlowAccelerator()

    def transform(batch):
        return {"obs": batch.data["obs"] * 2.0, "ids": batch.ids.clone()}

    for out in _stream(RowSource(num_batches=5), accel, device=None, transform=transform):
        assert accel.is_pinned(out["obs"]) and accel.is_pinned(out["ids"])
        assert torch.equal(out["obs"][:, 0], out["ids"].float() * 2)
    # ... and the device copy reads the pinned output (SlowAccelerator.copy asserts it).
    for out in _stream(RowSource(num_batches=5), accel, transform=transform):
        assert torch.equal(out["obs"][:, 0], out["ids"].float() * 2)


def test_transform_may_return_a_tensordict():
    tensordict = pytest.importorskip("tensordict")
    accel = SlowAccelerator()

    def transform(batch):
        return batch.to_tensordict()

    for out in _stream(RowSource(num_batches=3), accel, device=None, transform=transform):
        assert isinstance(out, tensordict.TensorDict)
        assert accel.is_pinned(out["obs"])


def test_no_pinning_without_an_accelerator_and_true_is_an_error():
    assert not resolve_delivery(None, "auto", accelerator=None).pin
    assert "no accelerator" in resolve_delivery(None, "auto", accelerator=None).note
    with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
        resolve_delivery(None, True, accelerator=None)
    with pytest.raises(ValueError, match="device='cuda'"):
        resolve_delivery("cuda", "auto", accelerator=None)
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_delivery("gpu please", "auto", accelerator=None)
    assert resolve_delivery("cpu", False, accelerator=SlowAccelerator()).device is None


def test_the_producer_stays_within_prefetch_of_the_learner():
    source = RowSource(num_batches=0)
    stream = _stream(source, None, device=None, pin_memory=False, prefetch=3)
    with stream:
        for _ in range(5):
            next(stream)
        assert wait_for(lambda: source.produced >= 8)
        assert stays(lambda: source.produced == 8)  # 5 taken + 3 ahead


def test_host_batches_reuse_prefetch_plus_one_buffers():
    pointers = set()
    for batch in _stream(RowSource(num_batches=30), None, device=None, pin_memory=False,
                         prefetch=2):
        pointers.add(batch.data["obs"].data_ptr())
    assert len(pointers) == 3


def test_close_ends_the_thread_and_a_second_close_is_harmless():
    stream = _stream(RowSource(num_batches=0), SlowAccelerator())
    next(stream)
    stream.close()
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "replay-stream-t"]
    with pytest.raises(StopIteration):
        next(stream)


def test_errors_of_the_source_reach_the_learner_after_earlier_batches():
    fail = threading.Event()
    stream = _stream(RowSource(num_batches=0, fail=fail), None, device=None, pin_memory=False,
                     prefetch=1)
    next(stream)
    fail.set()
    with pytest.raises(LookupError, match="the source failed"):
        for _ in range(5):
            next(stream)
    with pytest.raises(StopIteration):  # like a generator: a failed stream is over
        next(stream)


def test_bad_feed_options_are_refused():
    delivery = resolve_delivery(None, False, accelerator=None)
    with pytest.raises(ValueError, match="prefetch must be an integer >= 1"):
        FeedCore(0, delivery)
    with pytest.raises(ValueError, match="transform must be callable"):
        FeedCore(2, delivery, transform="not a function")  # type: ignore[arg-type]


def test_tensordict_with_index_and_weight_arrives_on_the_device():
    accel = SlowAccelerator()
    stream = _stream(RowSource(num_batches=5), accel, transform=SampleBatch.to_tensordict)
    for out in stream:
        assert torch.equal(out["index"], out["row"]) and out["index"].dtype == torch.int64
        assert torch.equal(out["_weight"], torch.ones(16))
        assert torch.equal(out["obs"][:, 3], out["index"].float())
    assert accel.copies == 5


def test_asking_for_the_next_batch_finishes_the_one_held_and_ack_finishes_it_sooner():
    """What a leased stream reports (replay_client.stream): a batch is finished when the
    learner asks for the next one, or when it says so (ack); never twice."""
    core = FeedCore(2, resolve_delivery(None, False))
    flow = core.flow()
    flow.opening()
    for index in range(3):
        rows = torch.arange(index * 4, index * 4 + 4)
        core.deliver(index, SampleBatch.from_columns(
            {"row": rows}, rows, torch.ones(4), torch.full((4,), 0.25, dtype=torch.float64)))
    core.take()
    assert flow.next_grant(block=False).finished == 0  # the first batch is held
    core.take()
    assert flow.next_grant(block=False).finished == 1
    assert core.ack() and not core.ack()  # the second batch, once
    core.take()
    assert flow.next_grant(block=False).finished == 1 and flow.finished == 2
    core.finish()
    with pytest.raises(StopIteration):
        core.take()  # asking past the end finishes the last batch
    assert flow.next_grant(block=False).finished == 1 and flow.finished == 3


def test_a_batch_given_back_runs_its_hook_on_the_learners_thread_before_its_credit():
    """What CUDA IPC records its *released* event in (replay_client.cuda_ipc_source): the
    hook of batch k runs when the learner asks for batch k + 1, on the learner's thread,
    before the credit that lets the source reuse batch k's memory is queued."""
    core = FeedCore(2, resolve_delivery(None, False))
    flow = core.flow()
    flow.opening()
    calls: list[tuple[int, int, bool]] = []  # (batch, thread, credit already queued)
    for index in range(3):
        rows = torch.arange(index * 4, index * 4 + 4)
        core.when_given_back(index, lambda index=index: calls.append(
            (index, threading.get_ident(), flow.next_grant(block=False).credits > 0)))
        core.deliver(index, SampleBatch.from_columns(
            {"row": rows}, rows, torch.ones(4), torch.full((4,), 0.25, dtype=torch.float64)))
    core.take()
    assert calls == []  # batch 0 is held
    flow.next_grant(block=False)  # (the first take's own credit)
    core.take()
    assert calls == [(0, threading.get_ident(), False)]
    core.finish()
    core.take()
    with pytest.raises(StopIteration):
        core.take()  # asking past the end gives the last batch back too
    assert [c[0] for c in calls] == [0, 1, 2]
