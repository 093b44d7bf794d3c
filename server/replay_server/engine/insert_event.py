"""What one insert changed: the event a table hands its sampler and its readers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class InsertEvent:
    """What one insert changed, as the sampler and the readers need to know it.

    Attributes:
        first_id: position of the first new row; the new positions are consecutive.
        count: number of new rows.
        evicted_first_id: position of the first row overwritten by this insert.
        evicted: number of rows overwritten (their slots now hold new rows).
        priorities: float64 ``[count]`` priorities of the new rows, already
            validated; ``None``: none given (a prioritized sampler then gives
            each the largest priority it has seen).
        episodes: int64 ``[count]`` episode ids (for samplers and readers with episodes).
        ends: bool ``[count]``: True where a row ends its episode (likewise).
    """

    first_id: int
    count: int
    evicted_first_id: int
    evicted: int
    priorities: np.ndarray | None = None
    episodes: np.ndarray | None = None
    ends: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        return np.arange(self.first_id, self.first_id + self.count, dtype=np.int64)

    @property
    def evicted_ids(self) -> np.ndarray:
        return np.arange(self.evicted_first_id, self.evicted_first_id + self.evicted, dtype=np.int64)
