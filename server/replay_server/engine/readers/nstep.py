"""n-step transitions built at sample time from the stored steps of one episode.

A table with ``n_step = n > 1`` (any sampler but a queue's) stores plain
one-step transitions and returns, for each sampled row ``t``, the n-step
transition that starts there (the first step's data, ids, priorities,
probabilities and weights, as TorchRL's ``MultiStep`` does)::

    reward            = sum_{k < m} gamma^k * reward[t + k]   (float64, added in step order,
                                                               cast to the column's dtype)
    done, truncated   = those of step t + m - 1
    next.*            = those of step t + m - 1  (the bootstrap observation)
    steps_to_next_obs = m                        (int64; bootstrap with gamma^m)

where ``t, t + 1, ...`` are the stored steps of ``t``'s episode in order
(however actors interleave their inserts) and ``m <= n`` stops early at the
step that ends the episode (``done`` or ``truncated``) or at the newest step
of an episode still running.

The index keeps, per slot, the slot of the next step of the same episode
(-1: none yet, or the episode ended there), linked at insert the way
:mod:`~replay_server.engine.samplers.episodes` links slices, and each slot's
*window* as of now: its discounted sum (float64), the slot of its last step
and ``m``. An insert extends the windows it lengthens: its own rows' and
those of the last ``n - 1`` steps of each episode it continues (kept per open
episode), adding each new step's term to the running sum, so the sum is
added in step order exactly as a scan of the window would add it. A step
after a stored row is always stored (the ring overwrites in insertion
order), so a window never touches an overwritten row. A sample is then the
plain gather with the ``next.*``, ``done`` and ``truncated`` columns read at
the window's last slot and the reward taken from the kept sums: a few lookups
of 256 elements, whatever ``n``.

It is a reader (:mod:`replay_server.engine.readers.base`): it reads the
first step's columns and the last step's bootstrap columns through the
reader below it, so the frames under it may be stacked, compressed, in a
file or on a device, and the positions it is asked for may be rows or
slices (``[B, L]``: each step of each slice is its n-step transition).

Checkpoints keep the links only (the windows depend on ``n_step``, ``gamma``
and ``reward_key``, which may change between runs); the windows are rebuilt
from the links and the stored rewards at the first insert or sample after a
load: O(live rows * n).

Cost: insert O(rows * log rows) (a sort by episode), a loop over the
insert's episodes for their bookkeeping, and up to ``n - 1`` rounds of vector
operations over the windows it extends (as many as the longest run of new
steps of one episode); sample O(B) lookups plus the usual gather. Memory: 26
bytes per slot.
Not thread-safe: called under the table's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.batch import STEPS_DTYPE, STEPS_KEY
from replay_proto.dtypes import numpy_dtype
from replay_server.engine.ids import IdRing
from replay_server.engine.insert_event import InsertEvent
from replay_server.engine.readers.base import Reader
from replay_server.engine.schema import Schema
from replay_server.engine.slot_memory import NSTEP_SLOT_BYTES
from replay_server.engine.snapshot import saved_copy

NEXT_PREFIX = "next."
"""Columns under ``next`` (``next.obs``...) come from the window's last step."""

_MIN_SWEEP = 1024

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
"""The reward dtypes numpy has (the others go through torch)."""


class NStepReturns(Reader):
    """Next-step links and n-step windows per slot (see the module).

    Args:
        ring: the table's id ring (positions).
        source: the reader below.
        schema: the table's schema (as inserted).
        n_step: steps per transition (>= 2, <= 1000).
        gamma: discount.
        reward_key, done_key, truncated_key: the columns it reads and replaces.
    """

    STATE_KEY = "nstep"
    SLOT_BYTES = NSTEP_SLOT_BYTES
    """Per slot: the next step's slot, the window's sum and last slot (int64, float64,
    int64) and its length (uint16)."""

    def __init__(self, ring: IdRing, source: Reader | None, schema: Schema | None, n_step: int,
                 gamma: float, reward_key: str, done_key: str, truncated_key: str) -> None:
        super().__init__(ring, source)
        self._schema = schema
        self.n_step = n_step
        self.gamma = gamma
        self.reward_key = reward_key
        self.end_keys = (done_key, truncated_key)
        cap = ring.capacity
        self._next = np.full(cap, -1, dtype=np.int64)  # the slot of the next step, or -1
        self._sum = np.zeros(cap, dtype=np.float64)  # the window's discounted reward
        self._last = np.zeros(cap, dtype=np.int64)  # the slot of the window's last step
        self._steps = np.zeros(cap, dtype=np.uint16)  # m
        # episode -> positions of its newest steps whose windows are not full (oldest first)
        self._open: dict[int, np.ndarray] = {}
        self._sweep_at = _MIN_SWEEP
        self._stale = False  # the windows need a rebuild from the links (after a load)
        self._discounts = gamma ** np.arange(n_step, dtype=np.float64)
        self._split: tuple[list[str], list[str], list[str]] | None = None

    # ------------------------------------------------------------------ insert

    def attach(self, source: Reader, schema: Schema) -> None:
        """Read through ``source``, rows of ``schema`` (when the table's schema is fixed)."""
        self.source, self._schema = source, schema

    def after_write(self, event: InsertEvent, columns: Mapping[str, torch.Tensor]) -> None:
        """Link the rows of ``event`` and extend the windows they lengthen.

        Call after the ring advanced past them and they were written. The
        rows are taken grouped by episode (a stable sort); only the open
        episodes' bookkeeping is a loop over the insert's episodes.
        """
        assert event.episodes is not None and event.ends is not None
        if self._stale:
            self._rebuild()
        cap = self._ring.capacity
        positions = event.ids
        self._next[positions % cap] = -1
        order = np.argsort(event.episodes, kind="stable")
        rows, episodes, ends = positions[order], event.episodes[order], event.ends[order]
        rewards = self._rewards(rows)
        heads = np.flatnonzero(episodes[1:] != episodes[:-1]) + 1
        starts = np.concatenate(([0], heads))
        lasts = np.concatenate((heads - 1, [rows.size - 1]))
        link = ~ends[:-1]  # a step that ends its episode links to nothing
        link[heads - 1] = False  # nor does an episode's last row here to another's first
        self._next[rows[:-1][link] % cap] = rows[1:][link] % cap
        breaks = ends.copy()  # where a window stops
        breaks[lasts] = True
        stops = np.flatnonzero(breaks)
        index = np.arange(rows.size)
        after = np.searchsorted(stops, index)
        room = stops[after] - index  # rows after each one before its window's stop
        tail_from = np.concatenate(([-1], stops))[after[lasts]] + 1  # each episode's last run
        waiting, waiting_at = self._carry_open(rows, episodes[starts], starts, lasts, tail_from,
                                               ends[lasts])
        new_slots = rows % cap
        slots, begins, summed, sums = new_slots, index + 1, np.ones(rows.size, np.int64), rewards
        if waiting:  # their windows continue at their episode's first new row
            joined = np.concatenate(waiting) % cap
            at = np.array(waiting_at, dtype=np.int64)
            self._next[np.array([p[-1] for p in waiting]) % cap] = new_slots[at]
            begins = np.concatenate((begins, np.repeat(at, [p.size for p in waiting])))
            room = np.concatenate((room, room[begins[rows.size:]] + 1))
            summed = np.concatenate((summed, self._steps[joined].astype(np.int64)))
            sums = np.concatenate((sums, self._sum[joined]))
            slots = np.concatenate((slots, joined))
        self._grow(slots, new_slots, begins, summed, room, sums, rewards)

    def _carry_open(self, rows: np.ndarray, episodes: np.ndarray, starts: np.ndarray,
                    lasts: np.ndarray, tail_from: np.ndarray, ended: np.ndarray
                    ) -> tuple[list[np.ndarray], list[int]]:
        """Carry each episode of an insert across it: the open steps an episode had before
        (still stored) whose windows the new rows lengthen, with where its new rows begin in
        ``rows``; and the steps left open after it (its last ``n_step - 1`` rows unless it
        ended). ``rows`` are grouped by episode; ``episodes``, ``starts``, ``lasts``,
        ``tail_from`` (each episode's last run's start) and ``ended`` are per episode.
        O(episodes) Python steps; the open map is swept when it doubled."""
        keep, first_live = self.n_step - 1, self._ring.first_live
        waiting: list[np.ndarray] = []  # steps whose windows this insert lengthens
        waiting_at: list[int] = []  # where their episode's new rows begin in ``rows``
        for episode, start, last, tail_start, done in zip(
                episodes.tolist(), starts.tolist(), lasts.tolist(), tail_from.tolist(),
                ended.tolist()):
            pending = self._open.pop(episode, None)
            if pending is not None:
                pending = pending[pending >= first_live]  # ascending: a suffix stays
                if pending.size:
                    waiting.append(pending)
                    waiting_at.append(start)
            if not done:
                tail = rows[max(tail_start, last + 1 - keep):last + 1]
                if tail.size < keep and tail_start == start and pending is not None:
                    tail = np.concatenate((pending[max(0, pending.size - keep + tail.size):], tail))
                self._open[episode] = tail
        if len(self._open) > self._sweep_at:
            self._open = {e: p for e, p in self._open.items() if p[-1] >= first_live}
            self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))
        return waiting, waiting_at

    def _grow(self, slots: np.ndarray, new_slots: np.ndarray, begins: np.ndarray,
              summed: np.ndarray, room: np.ndarray, sums: np.ndarray,
              rewards: np.ndarray) -> None:
        """Store the windows of ``slots``, lengthened along the new rows.

        ``new_slots`` and ``rewards``: the new rows, grouped by episode in
        step order. Window ``j`` has ``summed[j]`` steps in ``sums[j]``; its
        next steps are ``new_slots[begins[j]:]``, ``room[j]`` of them before
        it must stop, so it takes ``count = min(n - summed, room)`` more.
        Ordered by ``count`` (most first), each round adds one term to a
        prefix of the windows: ``max(count) <= n - 1`` rounds of a few vector
        operations, each window's terms added in step order.
        """
        n = self.n_step
        count = np.maximum(np.minimum(n - summed, room), 0)
        rank = np.argsort(-count, kind="stable")
        todo, done, total, begin = count[rank], summed[rank], sums[rank], begins[rank]  # copies
        widths = np.searchsorted(-todo, -np.arange(1, int(todo[0]) + 1), side="right")
        discount, step = done.copy(), begin.copy()  # per window: the next term's k and row
        for width in widths.tolist():
            total[:width] += self._discounts[discount[:width]] * rewards[step[:width]]
            discount[:width] += 1
            step[:width] += 1
        at = slots[rank]
        self._sum[at] = total
        self._steps[at] = done + todo
        grown = todo > 0
        self._last[at[grown]] = new_slots[begin[grown] + todo[grown] - 1]
        self._last[at[~grown]] = at[~grown]  # a new row alone in its window

    def _rewards(self, positions: np.ndarray) -> np.ndarray:
        """The stored rewards at ``positions`` as float64 (any float dtype, any storage)."""
        assert self.source is not None
        rewards = self.source.read(positions, [self.reward_key])[self.reward_key]
        return rewards.detach().to("cpu", torch.float64).numpy().reshape(positions.size)

    def _rebuild(self) -> None:
        """The windows of every live row, and the open episodes' waiting steps, from the links.

        Walks the links from every live row, one step per round: O(live rows * n).
        """
        self._stale = False
        cap, n, ring = self._ring.capacity, self.n_step, self._ring
        positions = np.arange(ring.first_live, ring.next_id, dtype=np.int64)
        slots = positions % cap
        by_slot = np.zeros(cap, dtype=np.float64)
        by_slot[slots] = self._rewards(positions)
        self._sum[slots] = by_slot[slots]
        self._last[slots] = slots
        steps = np.ones(slots.size, dtype=np.int64)
        following = self._next[slots]
        growing = np.flatnonzero(following >= 0)
        while growing.size and n > 1:
            at, step = slots[growing], following[growing]
            self._sum[at] += self._discounts[steps[growing]] * by_slot[step]
            self._last[at] = step
            steps[growing] += 1
            following[growing] = self._next[step]
            growing = growing[(following[growing] >= 0) & (steps[growing] < n)]
        self._steps[slots] = steps
        newest = self._open  # as loaded: episode -> [its newest position]
        self._open = {}
        short = steps < n
        for episode, last in newest.items():
            position = int(last[-1])
            if position >= ring.first_live:
                self._open[episode] = positions[short & (self._last[slots] == position % cap)]

    def clear(self) -> None:
        self._open.clear()

    # ------------------------------------------------------------------ sample

    def read(self, positions: np.ndarray | None, keys: list[str] | None = None,
             out: Mapping[str, torch.Tensor] | None = None,
             slots: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The n-step transitions starting at ``positions`` (int64, any shape ``S``, live rows)."""
        if self._stale:
            self._rebuild()
        assert self.source is not None and self._schema is not None
        if keys is None:
            if self._split is None:  # the batch's keys never change once the schema is fixed
                self._split = self._split_keys([*self.keys, STEPS_KEY])
            wanted, head, tail = self._split
        else:
            wanted, head, tail = self._split_keys(keys)
        if slots is None:
            assert positions is not None
            slots = self._ring.slots(positions)
        # tail: at each window's last step (in one read with the head: they may share rows)
        columns = self.source.read_steps(positions, slots, head, self._last[slots], tail, out)
        device = self.device
        if self.reward_key in wanted:
            columns[self.reward_key] = self._reward(slots, out, device)
        if STEPS_KEY in wanted:
            steps = None if out is None else out.get(STEPS_KEY)
            counts = torch.from_numpy(self._steps[slots].astype(numpy_dtype(STEPS_DTYPE)))
            if steps is None:
                steps = counts if device.type == "cpu" else counts.to(device)
            else:
                steps.copy_(counts)
            columns[STEPS_KEY] = steps
        return {key: columns[key] for key in wanted}

    def _split_keys(self, wanted: list[str]) -> tuple[list[str], list[str], list[str]]:
        """``wanted``, the keys read at a transition's first step and at its last."""
        tail = [k for k in wanted if k != self.reward_key and k != STEPS_KEY
                and (k.startswith(NEXT_PREFIX) or k in self.end_keys)]
        head = [k for k in wanted if k not in tail and k not in (self.reward_key, STEPS_KEY)]
        return wanted, head, tail

    def _reward(self, slots: np.ndarray, out: Mapping[str, torch.Tensor] | None,
                device: torch.device) -> torch.Tensor:
        """The windows' discounted sums in the reward column's dtype and shape."""
        assert self._schema is not None
        spec = self._schema[self.reward_key]
        sums = self._sum[slots].reshape(*slots.shape, *spec.shape)  # numpy's: cheaper than torch's
        numpy_type = _NUMPY.get(spec.dtype)
        total = (torch.from_numpy(sums.astype(numpy_type)) if numpy_type is not None
                 else torch.from_numpy(sums).to(spec.dtype))  # a dtype numpy lacks
        reward = None if out is None else out.get(self.reward_key)
        if reward is None:
            return total if device.type == "cpu" else total.to(device)
        reward.copy_(total.view(reward.shape))
        return reward

    def extra_layout(self, lead: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {**super().extra_layout(lead), STEPS_KEY: (STEPS_DTYPE, lead)}

    # ------------------------------------------------------------- persistence

    def state_dict(self, used: int) -> dict[str, Any]:
        episodes = list(self._open)
        return {"n_step": self.n_step,
                "next": torch.from_numpy(saved_copy(self._next[:used])),
                "open_episodes": torch.tensor(episodes, dtype=torch.int64),
                "open_last": torch.tensor([int(self._open[e][-1]) for e in episodes],
                                          dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the links; the windows are rebuilt at the next insert or sample (see the module)."""
        saved = state["next"].numpy()[: self._ring.capacity]
        self._next.fill(-1)
        self._next[: saved.size] = saved
        self._open = {int(e): np.array([int(p)], dtype=np.int64)
                      for e, p in zip(state["open_episodes"], state["open_last"])}
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))
        self._stale = True
