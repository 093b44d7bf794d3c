"""Episode chains and slice starts, maintained incrementally at insert.

Rows of one episode may arrive in many inserts, interleaved with other
episodes' rows, so an episode's steps are scattered over the ring. This index
links each stored row to the next step of its episode and tells the slice
samplers which rows are *valid slice starts*: rows followed by at least
``min_len - 1`` further steps of the same episode, all still stored
(``min_len`` is ``slice_len``, less the table's ``span_right``).

Invariants it relies on (both follow from FIFO eviction in insertion order, see
:mod:`replay_server.engine.ids`):

* an episode's steps are inserted in order, so the steps still stored are a
  contiguous run ending at its newest step;
* if a row is stored, every row inserted after it is stored.

Hence a start that is stored stays valid until it is itself evicted: a slice
never touches an overwritten row, and a start only has to be retracted when its
own row is evicted.

Per row the index keeps one int32 (int64 past 2**31 slots): the slot of the next
step of the same episode, or the row's own slot while it is the last stored step
of its episode (an ended episode's last step, or an open one's newest). So a
chain that runs past an episode's end repeats its last step: what a *partial*
slice (``strict_length = false``, or a span) returns past its end, keeping every
sample ``[B, slice_len]``; a reader tells the real steps by the repeated id.
Per open episode it keeps the ids of its last ``min_len - 1`` steps and its
newest id. An episode ends at a row whose ``done`` (or ``truncated``) is True;
rows that later reuse its episode id start a new episode. Open episodes whose
rows were all evicted are swept away, so actors that vanish mid-episode leak
nothing.

:meth:`EpisodeIndex.insert_tracking_heads` also reports each episode's *head*,
its first stored step: a new episode's first row, and, when eviction takes an
episode's first steps, the first of its steps still stored. With
``strict_length = false`` a head is a start however short its episode (TorchRL's
``SliceSampler(strict_length=False)``); a left span draws windows that begin
before it.

Cost per insert of n rows in g distinct episodes: O(n + g) vectorized work plus
O(g) Python steps (tracking heads, O(evicted) more). ``chain``: O(B * slice_len).
Neither depends on capacity or on the number of rows stored.

Not thread-safe: called under the table's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import InsertEvent
from replay_server.engine.slot_memory import index_dtype
from replay_server.engine.snapshot import saved_copy

_EMPTY = np.empty(0, dtype=np.int64)
_MIN_SWEEP = 1024


@dataclass(slots=True)
class _OpenEpisode:
    tail: np.ndarray  # ids of its last min(len, min_len - 1) steps, ascending
    last_id: int


class EpisodeIndex:
    """Links each row to its episode's next step and finds new slice starts.

    Args:
        ring: the table's ids.
        slice_len: steps a chain follows.
        min_len: steps a start needs stored (``slice_len`` unless a right span
            lets slices end early); at most ``slice_len``.
    """

    def __init__(self, ring: IdRing, slice_len: int, min_len: int | None = None) -> None:
        self._ring = ring
        self.slice_len = slice_len
        self.min_len = slice_len if min_len is None else min_len
        # _next[slot]: slot of the next step of the row in ``slot``; read only along
        # chains from valid starts, whose every link was written when its target arrived.
        self._next = np.zeros(ring.capacity, dtype=index_dtype(ring.capacity))
        self._open: dict[int, _OpenEpisode] = {}
        self._sweep_at = _MIN_SWEEP

    @property
    def open_episodes(self) -> int:
        return len(self._open)

    def insert(self, event: InsertEvent) -> np.ndarray:
        """Record the rows of ``event``; return the ids (int64) that became valid starts.

        Must be called after the ring has advanced past the insert.
        """
        return self._insert(event, None)

    def insert_tracking_heads(self, event: InsertEvent) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`insert`, and the ids (int64) that became their episode's first stored
        step: new episodes' first rows, and each row whose previous step ``event``
        evicted (read before the new rows' links overwrite the evicted rows').
        A head may be a start already, or become one later."""
        heads = [self._successors(event)]
        starts = self._insert(event, heads)
        return starts, np.concatenate(heads) if len(heads) > 1 else heads[0]

    def _insert(self, event: InsertEvent, heads: list[np.ndarray] | None) -> np.ndarray:
        assert event.episodes is not None and event.ends is not None
        first_live = self._ring.first_live
        ids = np.arange(event.first_id, event.first_id + event.count, dtype=np.int64)
        episodes = event.episodes
        ends = event.ends

        if event.count and (episodes[0] == episodes).all():
            groups = [(int(episodes[0]), ids, ends)]
        else:
            order = np.argsort(episodes, kind="stable")
            sorted_eps = episodes[order]
            cuts = np.flatnonzero(sorted_eps[1:] != sorted_eps[:-1]) + 1
            groups = [
                (int(sorted_eps[idx[0]]), ids[order[idx]], ends[order[idx]])
                for idx in np.split(np.arange(event.count), cuts)
            ]

        starts: list[np.ndarray] = []
        for episode, group_ids, group_ends in groups:
            self._append(episode, group_ids, group_ends, first_live, starts, heads)

        if len(self._open) > self._sweep_at:
            self._sweep(first_live)
        if not starts:
            return _EMPTY
        new = np.concatenate(starts) if len(starts) > 1 else starts[0]
        return new[new >= first_live]

    def _append(
        self,
        episode: int,
        ids: np.ndarray,
        ends: np.ndarray,
        first_live: int,
        starts: list[np.ndarray],
        heads: list[np.ndarray] | None,
    ) -> None:
        """Append one episode's new rows (ascending ids), splitting where episodes end."""
        cap = self._ring.capacity
        nxt = self._next
        keep = self.min_len - 1
        previous = self._open.pop(episode, None)
        cuts = np.flatnonzero(ends) + 1
        segments = np.split(ids, cuts) if cuts.size else [ids]
        for i, segment in enumerate(segments):
            if segment.size == 0:
                continue
            tail = _EMPTY
            if i == 0 and previous is not None and previous.last_id >= first_live:
                nxt[previous.last_id % cap] = segment[0] % cap
                tail = previous.tail
            elif heads is not None:  # the first step of an episode (or of what is stored)
                heads.append(segment[:1])
            if segment.size > 1:
                nxt[segment[:-1] % cap] = segment[1:] % cap
            last = segment[-1] % cap
            nxt[last] = last  # the episode's last stored step, until a next one arrives
            run = np.concatenate((tail, segment)) if tail.size else segment
            if run.size > keep:
                starts.append(run[: run.size - keep])
            if i == len(cuts):  # the last segment did not end: the episode stays open
                self._open[episode] = _OpenEpisode(
                    run[-keep:].copy() if keep else _EMPTY, int(segment[-1])
                )

    def _successors(self, event: InsertEvent) -> np.ndarray:
        """Ids (int64) of the rows that became the first stored step of their episode
        because ``event`` evicted the steps before them (each evicted row whose next
        step is still stored). Cost: O(evicted)."""
        if not event.evicted:
            return _EMPTY
        slots = self._ring.slots(event.evicted_ids)
        nxt = self._next[slots].astype(np.int64)
        nxt = nxt[nxt != slots]  # an episode's last step links to itself
        ids = self._ring.ids_of_slots(nxt)
        # a slot the insert reused holds a new row: that next step was evicted too
        return ids[(ids < event.first_id) & self._ring.live(ids)]

    def _sweep(self, first_live: int) -> None:
        """Forget open episodes whose rows have all been evicted."""
        self._open = {e: o for e, o in self._open.items() if o.last_id >= first_live}
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))

    def chain(self, start_slots: np.ndarray) -> np.ndarray:
        """Slots of each start's ``slice_len`` consecutive steps: ``[B]`` -> int64 ``[B, slice_len]``;
        past its episode's last stored step a chain repeats that step.

        Every start must be a valid start (returned by :meth:`insert`, not evicted since).
        Cost: ``slice_len - 1`` vectorized lookups of B slots.
        """
        steps = np.empty((self.slice_len, start_slots.size), dtype=self._next.dtype)
        steps[0] = start_slots
        take = self._next.take  # the method: np.take's wrapper costs as much again per step
        for k in range(1, self.slice_len):
            take(steps[k - 1], out=steps[k])
        return steps.T.astype(np.int64)

    def clear(self) -> None:
        self._open.clear()
        self._sweep_at = _MIN_SWEEP

    def state_dict(self, used: int) -> dict[str, Any]:
        keep = self.min_len - 1
        episodes = list(self._open)
        tails = torch.full((len(episodes), keep), -1, dtype=torch.int64)
        lengths = torch.zeros(len(episodes), dtype=torch.int64)
        for row, episode in enumerate(episodes):
            tail = self._open[episode].tail
            lengths[row] = tail.size
            tails[row, : tail.size] = torch.from_numpy(tail)
        return {
            "next": torch.from_numpy(saved_copy(self._next[:used])),
            "open_episodes": torch.tensor(episodes, dtype=torch.int64),
            "open_last_ids": torch.tensor(
                [o.last_id for o in self._open.values()], dtype=torch.int64
            ),
            "open_tails": tails,
            "open_tail_lengths": lengths,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["next"].numpy()
        self._next.fill(0)
        self._next[: saved.size] = saved
        self._open = {
            int(e): _OpenEpisode(tail[: int(n)].numpy().copy(), int(last))
            for e, last, tail, n in zip(
                state["open_episodes"],
                state["open_last_ids"],
                state["open_tails"],
                state["open_tail_lengths"],
            )
        }
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))
