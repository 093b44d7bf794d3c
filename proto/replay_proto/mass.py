"""A table's sampling mass: what a sharded client needs to merge many shards' samples into one.

A *drawable unit* is a row (row samplers) or a valid slice start (slice
samplers); its mass is ``p ** alpha`` (prioritized samplers) or 1 (uniform
ones), and one table draws a unit with probability ``mass / total``. A
client holding the masses of every shard of one logical table can therefore
split a batch across shards in proportion to their totals and turn each
shard's local probabilities into the probabilities of the union (see
``replay_client.merge`` and ``docs/scale-out.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from replay_proto.v1 import replay_pb2 as pb


@dataclass(frozen=True, slots=True)
class SamplingMass:
    """One table's sampling mass at one moment.

    Attributes:
        total: sum of the drawable units' masses (0: nothing can be drawn).
        min_positive: the smallest positive mass of one unit (``inf``: none).
        count: drawable units (rows, or valid slice starts).
    """

    total: float
    min_positive: float
    count: int

    def to_proto(self) -> pb.SamplingMass:
        return pb.SamplingMass(total=self.total, min_positive=self.min_positive, count=self.count)

    @classmethod
    def from_proto(cls, message: pb.SamplingMass) -> SamplingMass:
        return cls(float(message.total), float(message.min_positive), int(message.count))


def uniform_mass(count: int) -> SamplingMass:
    """The mass of ``count`` units of mass 1 each (uniform and slice samplers)."""
    return SamplingMass(float(count), 1.0 if count else math.inf, int(count))


def union_mass(masses: Iterable[SamplingMass]) -> SamplingMass:
    """The mass of tables drawn from as one (a table's shards): totals and counts summed, the
    smallest positive unit the least of theirs."""
    masses = list(masses)
    return SamplingMass(math.fsum(m.total for m in masses),
                        min((m.min_positive for m in masses), default=math.inf),
                        sum(m.count for m in masses))
