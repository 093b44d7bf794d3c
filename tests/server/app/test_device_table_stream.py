"""The in-process stream of a device table hands the learner its batches with no host copy.

On the CPU stand-in (:func:`~replay_server.engine.storage.placement.cpu_stand_in`)
the table's "device" is the CPU, so the learner's feed is given a delivery to
that same device, with an accelerator that records every pinned buffer and
device copy it is asked for. A device table's batches arrive already on the
delivery's device: the feed must hand them over as they are (no staging
buffers, no pinning, no copy; ``stream.stats.resident``). The same stream over
a host table goes the usual way: the table gathers into the feed's staging
buffers, which the recorder sees allocated. (On the stand-in those are on the
"device" too; that a batch off the device is copied, and one on it is not, is
tested with the simulated accelerator in ``tests/feed/test_resident.py``.)
The GPU version is ``tests/gpu/test_device_table.py``.
"""

from __future__ import annotations

import torch

from replay_feed import BatchStream, FeedCore
from replay_feed.delivery import Delivery
from replay_feed.source import LinkSource
from replay_server.app.embedded import TableLink
from replay_server.engine.config import TableConfig
from replay_server.engine.storage.placement import cpu_stand_in
from replay_server.engine.table import Table


class RecordingAccelerator:
    """An accelerator for the CPU "device": it records what the feed asks of it."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.pinned = 0
        self.copies = 0
        self.records = 0
        self.consumed = 0

    def pinned_empty(self, shape, dtype):
        self.pinned += 1
        return torch.empty(tuple(shape), dtype=dtype)

    def is_pinned(self, tensor):
        return True

    def register(self, tensor):
        return False

    def unregister(self, tensor):
        pass

    def copy(self, tensors, device):
        self.copies += 1
        return [t.clone() for t in tensors], None

    def consume(self, tensors, event):
        self.consumed += 1

    def synchronize(self, event):
        pass

    def record(self, device):
        self.records += 1
        return object()  # an event the learner's stream is made to wait for


def _stream(table: Table, accel: RecordingAccelerator, batches: int) -> BatchStream:
    delivery = Delivery(torch.device("cpu"), True, accel, "the CPU stand-in's device")
    core = FeedCore(2, delivery)
    return BatchStream(core, LinkSource(TableLink(table, 32, core.staging), num_batches=batches),
                       table.name)


def _filled(device: str) -> Table:
    table = Table(TableConfig(name="t", capacity=500, sampler="prioritized", seed=3,
                              device=device))
    rows = torch.arange(500)
    table.insert({"row": rows, "obs": (rows % 251).to(torch.uint8).view(-1, 1).expand(500, 64)})
    return table


def test_a_device_tables_batches_reach_the_learner_with_no_staging_pinning_or_copy():
    with cpu_stand_in():
        table = _filled("cuda")
        accel = RecordingAccelerator()
        stream = _stream(table, accel, 20)
        seen = 0
        for batch in stream:
            assert torch.equal(batch.data["obs"][:, 0], (batch.data["row"] % 251).to(torch.uint8))
            seen += 1
            stats = stream.stats  # checked while the stream is live
            assert stats.resident >= stats.batches == seen  # prepared ahead, within prefetch
            assert stats.pinned_copies == stats.pageable_copies == 0
        assert seen == stream.stats.resident == 20 and accel.copies == 0 and accel.pinned == 0
        # ... but the learner's stream was made to wait for each batch's gather.
        assert accel.records == accel.consumed == 20


def test_a_host_tables_batches_are_gathered_into_staging_as_before():
    table = _filled("cpu")
    accel = RecordingAccelerator()
    stream = _stream(table, accel, 20)
    staged = []
    for batch in stream:
        staged.append(batch.columns["obs"].data_ptr())
    # Staging sets are made per batch in flight or held: at most prefetch + 1 = 3 (how
    # many depends on how far ahead the producer got: 2 in a quiet clean-clone CI run),
    # every one pinned (both columns), and the 20 batches were those sets, reused.
    sets = len(set(staged))
    assert 1 <= sets <= 3 and len(staged) == 20
    assert accel.pinned == 2 * sets
