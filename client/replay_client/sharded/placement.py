"""Which shard an insert's rows go to.

Two rules, chosen per insert by what the rows carry:

* **By episode.** Rows that carry the table's episode column (every row of a
  slice table; every row a :class:`~replay_client.writer.Writer` sends, which
  adds the writer's episode id) go to the shard its episode id hashes to:
  ``shards[mix(episode) % len(shards)]`` over the shards in index order
  (``mix``: SplitMix64's finalizer, so ids 0, 1, 2, ... spread as well as
  random ones). Every row of an episode lands on the same shard, however the
  rows are batched or interleaved with other actors' rows, so a slice sampler
  never sees a cut episode. An insert holding several episodes is split into
  one insert per shard.
* **Round-robin.** Other inserts go whole to one shard, the next in turn,
  starting at a random shard per client (so many actors do not all begin with
  the same one). Consecutive calls of one client spread evenly.

Placement depends on the set of shards: adding a shard moves where new
episodes go (rows already stored stay where they are). Exactness of sampling
does not depend on placement (see :mod:`replay_client.sharded.merge`); balance does:
mass is best spread evenly, since a draw's cost on a shard grows with its share.

Cost: by episode O(rows) (one hash per row and a stable partition); round-robin O(1).
Thread-safety: :class:`RoundRobin` takes a lock; the functions are pure.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of int64 ``values`` (a bijection that spreads nearby ids), uint64."""
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def by_episode(episodes: np.ndarray, shards: Sequence[int]) -> dict[int, np.ndarray]:
    """Row indices per shard for rows with these episode ids (each episode on one shard).

    Args:
        episodes: int64 ``[rows]`` episode ids.
        shards: the shards to place on, in index order.

    Returns:
        shard -> int64 row indices (ascending), for the shards that get rows.
    """
    if not shards:
        raise ValueError("no shard to place rows on")
    target = (mix(episodes) % np.uint64(len(shards))).astype(np.int64)
    if len(shards) == 1 or (target == target[0]).all():
        return {shards[int(target[0])]: np.arange(episodes.size)} if episodes.size else {}
    return {shards[t]: np.flatnonzero(target == t) for t in np.unique(target).tolist()}


class RoundRobin:
    """The next shard in turn, from a random start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = secrets.randbelow(1 << 30)

    def next(self, shards: Sequence[int]) -> int:
        if not shards:
            raise ValueError("no shard to place rows on")
        with self._lock:
            turn, self._next = self._next, self._next + 1
        return shards[turn % len(shards)]
