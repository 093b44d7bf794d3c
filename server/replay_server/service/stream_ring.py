"""A stream batch's layout in a shared-memory ring slot (see :mod:`replay_server.service.sample_stream`)."""

from __future__ import annotations

import torch

from replay_feed.shared_ring import SharedRing, align
from replay_proto.batch import SampleBatch


class RingLayout:
    """Where each tensor of one batch lies in a ring slot (64-byte aligned offsets).

    Args:
        batch: a drawn batch or group (its first ``batch_size`` rows give the layout).
        batch_size: rows per batch.
    """

    def __init__(self, batch: SampleBatch, batch_size: int) -> None:
        self.keys = list(batch.columns)
        tensors = [t[:batch_size] for t in batch.tensors()]
        self.specs = [(t.dtype, tuple(t.shape)) for t in tensors]
        self.offsets = []
        offset = 0
        for t in tensors:
            self.offsets.append(offset)
            offset = align(offset + t.numel() * t.element_size())
        self.slot_bytes = max(offset, 1)

    def views(self, ring: SharedRing, slot: int) -> list[torch.Tensor]:
        return [ring.view(slot, off, dtype, shape)
                for off, (dtype, shape) in zip(self.offsets, self.specs)]
