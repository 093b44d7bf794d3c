"""What an RLlib buffer remembers of the episodes it added, bounded by the rows they fill.

A table keys a row's episode by an int64 (:func:`~replay_server.ray.rllib_rows.episode_number`);
RLlib's episodes carry string ids (and, for an agent of a multi-agent episode,
its agent, module and multi-agent episode ids). A buffer keeps those per
episode so that a sampled row comes back with the ids its episode had. Kept
for every episode ever added, that map grew by one entry (~200 bytes) per
episode for the whole run: millions of entries over a long one.

:class:`EpisodeWindow` keeps them only for the episodes whose rows the replay
can still hold: those among the last ``rows`` rows added (a table of that
capacity has overwritten the rows before them; the buffers pass the capacity
of their tables). An episode evicted from the window whose rows a shard still
holds (shards fill unevenly, rows go to a shard by episode) comes back with
ids derived from its number, as rows another writer stored do. A later chunk
of an episode (RLlib adds long episodes in pieces) renews it. The window also
counts the episodes ever added (RLlib's ``get_num_episodes`` counters).

Cost: O(1) amortised per episode added; memory O(episodes among the last
``rows`` rows), at most ``rows`` entries. Thread-safety: none (the buffers are
called from one thread, as RLlib's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class EpisodeWindow(Generic[K, V]):
    """Episode key -> what a buffer knows of it, for the episodes of the last ``rows`` rows.

    Args:
        rows: how many of the latest rows added the window covers (>= 1): the capacity
            of the table(s) the episodes' rows go to.

    Attributes:
        added: episodes ever added (a key not in the window when added counts again).

    Raises:
        ValueError: ``rows`` < 1.
    """

    def __init__(self, rows: int) -> None:
        if int(rows) < 1:
            raise ValueError(f"EpisodeWindow: rows must be >= 1, got {rows!r}")
        self.rows = int(rows)
        self.added = 0
        self._known: OrderedDict[K, list] = OrderedDict()  # key -> [value, its rows here]
        self._total = 0  # rows of the episodes in the window

    def add(self, key: K, value: V, rows: int) -> bool:
        """Note ``rows`` more rows of episode ``key`` (``value``: what to keep of it, taken
        only when it is new). Returns whether it was new (not in the window)."""
        known = self._known.get(key)
        new = known is None
        if known is None:
            entry = self._known[key] = [value, 0]
            self.added += 1
        else:
            entry = known
            self._known.move_to_end(key)  # its newest rows are the latest added
        entry[1] += rows
        self._total += rows
        self._evict()
        return new

    def _evict(self) -> None:
        """Forget the oldest episodes while the rest still cover the last ``rows`` rows."""
        while len(self._known) > 1:
            oldest = next(iter(self._known.values()))
            if self._total - oldest[1] < self.rows:
                return
            self._total -= oldest[1]
            self._known.popitem(last=False)

    def get(self, key: K) -> V | None:
        """What was kept of episode ``key``, if it is in the window."""
        entry = self._known.get(key)
        return None if entry is None else entry[0]

    def __contains__(self, key: object) -> bool:
        return key in self._known

    def __len__(self) -> int:
        return len(self._known)

    def state(self) -> dict:
        """The window as plain data (for an RLlib checkpoint): its episodes oldest first."""
        return {"rows": self.rows, "added": self.added,
                "episodes": [[key, value, rows] for key, (value, rows) in self._known.items()]}

    def restore(self, episodes: Iterable[tuple[K, V, int]], added: int) -> None:
        """Replace the window's contents with ``episodes`` (key, value, rows; oldest first)
        and its count of episodes added with ``added``."""
        self._known.clear()
        self._total = 0
        for key, value, rows in episodes:
            self._known[key] = [value, int(rows)]
            self._total += int(rows)
        self._evict()
        self.added = int(added)
