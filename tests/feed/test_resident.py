"""A batch already on the delivery's device is handed over with no pinning and no copy.

A device table sampled in process produces such batches. With the simulated
accelerator of :mod:`tests.feed.test_core` (device ``meta``): a batch whose
every tensor is on ``meta`` counts as ``resident`` and is never pinned or
copied; a batch with any host tensor (here: host extras beside device
columns) is pinned and copied as before.
"""

from __future__ import annotations

import torch

from replay_feed import BatchStream, FeedCore, resolve_delivery
from replay_proto.batch import SampleBatch
from tests.feed.test_core import SlowAccelerator, wait_credits


class DeviceSource:
    """Batches built on ``meta``; ``host_extras``: ids, weights and probabilities on the host."""

    def __init__(self, host_extras: bool, num_batches: int = 12) -> None:
        self.host_extras = host_extras
        self.num_batches = num_batches
        self.stopped = False

    def run(self, core: FeedCore) -> None:
        credits = core.prefetch
        for index in range(self.num_batches):
            while credits == 0:
                credits += wait_credits(core)
                if core.stopping.is_set():
                    return
            extras = "cpu" if self.host_extras else "meta"
            core.deliver(index, SampleBatch.from_columns(
                {"obs": torch.empty(8, 4, device="meta")},
                torch.arange(8, device=extras), torch.ones(8, device=extras),
                torch.ones(8, dtype=torch.float64, device=extras)))
            credits -= 1

    def stop(self) -> None:
        self.stopped = True


class MixedAccelerator(SlowAccelerator):
    """Copies batches whose host tensors are pinned (its device tensors are left as they are)."""

    def copy(self, tensors, device):
        assert all(self.is_pinned(t) for t in tensors if t.device.type == "cpu")
        self.copies += 1
        return list(tensors), None

    def record(self, device):
        return None


def _run(host_extras: bool) -> tuple[BatchStream, SlowAccelerator, list[SampleBatch]]:
    accel = MixedAccelerator(delay=0)
    stream = BatchStream(FeedCore(2, resolve_delivery("meta", "auto", accelerator=accel)),
                         DeviceSource(host_extras), "t")
    return stream, accel, list(stream)


def test_a_batch_on_the_delivery_device_is_not_pinned_or_copied():
    stream, accel, batches = _run(host_extras=False)
    assert len(batches) == 12 and all(t.is_meta for b in batches for t in b.tensors())
    assert stream.stats.resident == 12 and accel.copies == 0 and accel.pinned == []
    assert stream.stats.pinned_copies == stream.stats.pageable_copies == 0


def test_a_batch_partly_on_the_host_is_pinned_and_copied():
    stream, accel, batches = _run(host_extras=True)
    assert len(batches) == 12 and stream.stats.resident == 0
    assert accel.copies == 12 and stream.stats.pinned_copies == 12 and accel.pinned
