"""Uniform sampling over the rows present."""

from __future__ import annotations

import numpy as np

from replay_server.errors import EmptyTableError
from replay_server.samplers.base import InsertEvent, Sampler, SampleIndex, uniform_draws


class UniformSampler(Sampler):
    """Every present row is drawn with probability ``1 / size``.

    The rows present are exactly the ids ``[first_live, next_id)`` (see
    :mod:`replay_server.ids`), so sampling draws integers in that range and
    needs no per-row state at all.

    Cost: ``sample`` O(B); ``insert``/``clear`` O(1). Memory: none per row.
    """

    def insert(self, event: InsertEvent) -> None:
        pass

    def sample(self, batch_size: int, generator: np.random.Generator) -> SampleIndex:
        size = self._ring.size
        if size == 0:
            raise EmptyTableError("the table is empty")
        ids = uniform_draws(generator, size, batch_size) + self._ring.first_live
        return SampleIndex(
            ids=ids,
            slots=self._ring.slots(ids),
            probabilities=np.full(batch_size, 1.0 / size),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def clear(self) -> None:
        pass
