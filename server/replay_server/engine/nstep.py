"""n-step transitions built at sample time from the stored steps of one episode.

A table with ``n_step = n > 1`` (uniform or prioritized sampler) stores plain
one-step transitions and returns, for each sampled row ``t``, the n-step
transition that starts there (the first step's data, ids, priorities,
probabilities and weights, as TorchRL's ``MultiStep`` does)::

    reward            = sum_{k < m} gamma^k * reward[t + k]   (float64 sum, cast to the column's dtype)
    done, truncated   = those of step t + m - 1
    next.*            = those of step t + m - 1  (the bootstrap observation)
    steps_to_next_obs = m                        (int64; bootstrap with gamma^m)

where ``t, t + 1, ...`` are the stored steps of ``t``'s episode in order
(however actors interleave their inserts) and ``m <= n`` stops early at the
step that ends the episode (``done`` or ``truncated``) or at the newest step
of an episode still running. Every other column is that of step ``t``.

The index keeps, per slot, the slot of the next step of the same episode
(-1: none yet, or the episode ended there), linked at insert the way
:mod:`~replay_server.engine.samplers.episodes` links slices; a slot's link
is reset when a new row takes the slot. A step after a stored row is always
stored (the ring overwrites in insertion order), so the window never
touches an overwritten row.

Cost: insert O(rows + episodes); sample O(B * n) lookups of 8 bytes plus
the usual gather (the ``next.*``, ``done`` and ``truncated`` columns are
read at the window's last step instead of the first). Memory: 8 bytes per
slot. Not thread-safe: called under the table's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import InsertEvent
from replay_server.engine.snapshot import saved_copy
from replay_server.engine.storage import ColumnStorage

STEPS_KEY = "steps_to_next_obs"
"""The batch column holding each transition's number of steps ``m`` (TorchRL's name)."""

NEXT_PREFIX = "next."
"""Columns under ``next`` (``next.obs``...) come from the window's last step."""

_MIN_SWEEP = 1024


class NStepIndex:
    """Next-step links per slot, and the n-step windows of sampled rows (see the module).

    Args:
        ring: the table's id ring (positions).
        n_step: steps per transition (>= 2).
        gamma: discount.
        reward_key, done_key, truncated_key: the columns it reads and replaces.
    """

    def __init__(self, ring: IdRing, n_step: int, gamma: float, reward_key: str,
                 done_key: str, truncated_key: str) -> None:
        self._ring = ring
        self.n_step = n_step
        self.gamma = gamma
        self.reward_key = reward_key
        self.end_keys = (done_key, truncated_key)
        # _next[slot]: the slot of the next step, or -1; one more entry, always -1, so that
        # following a -1 (index -1: the last entry) stays -1.
        self._next = np.full(ring.capacity + 1, -1, dtype=np.int64)
        self._keys: tuple[list[str], list[str]] | None = None  # (first step's, last step's)
        self._open: dict[int, int] = {}  # episode -> position of its newest step
        self._sweep_at = _MIN_SWEEP
        self._discounts = gamma ** np.arange(n_step, dtype=np.float64)

    # ------------------------------------------------------------------ insert

    def insert(self, event: InsertEvent) -> None:
        """Link the rows of ``event`` (after the ring advanced past them)."""
        assert event.episodes is not None and event.ends is not None
        cap = self._ring.capacity
        positions = np.arange(event.first_id, event.first_id + event.count, dtype=np.int64)
        self._next[positions % cap] = -1
        episodes, ends = event.episodes, event.ends
        order = np.argsort(episodes, kind="stable")
        sorted_eps = episodes[order]
        cuts = np.flatnonzero(sorted_eps[1:] != sorted_eps[:-1]) + 1
        first_live = self._ring.first_live
        for group in np.split(order, cuts):
            episode = int(episodes[group[0]])
            mine, mine_ends = positions[group], ends[group]
            previous = self._open.pop(episode, None)
            if previous is not None and previous >= first_live:
                self._next[previous % cap] = mine[0] % cap
            follows = ~mine_ends[:-1]  # a step that ends its episode links to nothing
            self._next[mine[:-1][follows] % cap] = mine[1:][follows] % cap
            if not mine_ends[-1]:
                self._open[episode] = int(mine[-1])
        if len(self._open) > self._sweep_at:
            self._open = {e: p for e, p in self._open.items() if p >= first_live}
            self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))

    def clear(self) -> None:
        self._open.clear()

    # ------------------------------------------------------------------ sample

    def gather(self, storage: ColumnStorage, positions: np.ndarray,
               out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The n-step transitions starting at ``positions`` (int64 ``[B]``, live rows)."""
        cap = self._ring.capacity
        views = storage.views
        if self._keys is None:
            tail = [key for key in views if key.startswith(NEXT_PREFIX) or key in self.end_keys]
            self._keys = ([key for key in views if key not in tail], tail)
        head_keys, tail_keys = self._keys
        rewards = views[self.reward_key].reshape(cap)
        first = positions % cap
        # chain[k]: the slot of step t + k, or -1 past the window's end (the link of a step
        # that ended its episode, or of its episode's newest step, is -1, and so is the
        # sentinel _next[-1], so -1 stays -1).
        chain = np.empty((self.n_step, first.size), dtype=np.int64)
        chain[0] = first
        for k in range(1, self.n_step):
            np.take(self._next, chain[k - 1], out=chain[k])
        inside = chain >= 0
        steps = inside.sum(axis=0)
        terms = rewards[chain].astype(np.float64)  # -1 reads the last slot: masked next
        terms *= self._discounts[:, None]
        terms[~inside] = 0.0
        total = terms.sum(axis=0)  # in step order, as a running sum would add them
        slots = chain[steps - 1, np.arange(first.size)]
        columns = storage.gather(first, out, keys=head_keys)
        columns.update(storage.gather(slots, out, keys=tail_keys))
        reward = columns[self.reward_key]
        if reward.dtype == torch.bfloat16:  # numpy has no bfloat16
            reward.copy_(torch.from_numpy(total).to(reward.dtype).view(reward.shape))
        else:
            np.copyto(reward.numpy().reshape(-1), total, casting="unsafe")
        steps_out = None if out is None else out.get(STEPS_KEY)
        if steps_out is None:
            columns[STEPS_KEY] = torch.from_numpy(steps)
        else:
            steps_out.copy_(torch.from_numpy(steps))
            columns[STEPS_KEY] = steps_out
        return columns

    # ------------------------------------------------------------- persistence

    def state_dict(self, used: int) -> dict[str, Any]:
        episodes = list(self._open)
        return {"n_step": self.n_step,
                "next": torch.from_numpy(saved_copy(self._next[:used])),
                "open_episodes": torch.tensor(episodes, dtype=torch.int64),
                "open_last": torch.tensor([self._open[e] for e in episodes], dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["next"].numpy()[: self._ring.capacity]
        self._next.fill(-1)
        self._next[: saved.size] = saved
        self._open = {int(e): int(p) for e, p in zip(state["open_episodes"], state["open_last"])}
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))
