"""Storage positions of row ids, computed from what ``info`` reports (no call per sample).

A table's rows lie in a ring of ``capacity`` slots; TorchRL calls a row's
slot its *storage position* (``rb[i]``, a sample's ``"index"``). A row's id
(:mod:`replay_proto.id_layout`) names its shard, its id segment (the
incarnation) and its sequence in that segment; ``info`` reports where each
segment that holds stored rows began (``TableInfo.id_segments``), so the
position of a stored row is ``(first_position + sequence) % capacity``.

Over shards (a sharded client's summed ``info``) the positions of the
shards' rings are laid end to end in shard order: a row of the ``k``-th
shard that answered lies at ``offset + its position there``, ``offset``
being the summed capacity of the shards before it, so positions run over
``0 .. summed capacity - 1``, as one storage of the summed capacity.

Thread-safety: immutable values and pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from replay_proto.id_layout import INCARNATION_BITS, INCARNATION_SHIFT, SEQUENCE_MASK


@dataclass(frozen=True, slots=True)
class IdSegment:
    """Where the rows of one id segment lie.

    Attributes:
        shard: the shard that issued the segment's ids.
        incarnation: the segment's incarnation (bits 40..55 of its ids).
        first_position: the table's insertion count when the segment began.
        capacity: the shard's table capacity (its ring's slots).
        offset: where that shard's positions start among all shards' (0 for one server).
    """

    shard: int
    incarnation: int
    first_position: int
    capacity: int
    offset: int = 0

    def moved(self, offset: int) -> IdSegment:
        """The same segment with its shard's positions starting ``offset`` further on."""
        return IdSegment(self.shard, self.incarnation, self.first_position, self.capacity,
                         self.offset + offset)


def positions_of(ids: Any, segments: tuple[IdSegment, ...]) -> np.ndarray:
    """Storage positions (int64, ``ids``' shape) of ``ids``; -1 where no segment issued the id
    (an id of a segment ``info`` did not list: ask ``info`` again).

    Cost: one vectorized pass over the ids per segment (usually one or two).
    """
    values = np.asarray(ids, dtype=np.int64)
    prefix = values >> INCARNATION_SHIFT  # shard, then incarnation
    sequences = values & SEQUENCE_MASK
    out = None
    for segment in segments:
        mine = prefix == ((segment.shard << INCARNATION_BITS) | segment.incarnation)
        if out is None and mine.all():  # every id of one segment (a sample, usually)
            return segment.offset + (segment.first_position + sequences) % segment.capacity
        if out is None:
            out = np.full(values.shape, -1, dtype=np.int64)
        out[mine] = segment.offset + (segment.first_position + sequences[mine]) % segment.capacity
    return np.full(values.shape, -1, dtype=np.int64) if out is None else out
