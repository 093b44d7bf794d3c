"""Episode ids for tables that keep episodes, from the trajectory data TorchRL scripts write.

A slice table keeps an episode's steps together by the ids in its
``episode_key`` column. TorchRL's ``SliceSampler`` finds trajectories itself,
in the storage: by a ``traj_key`` column of trajectory ids, or by end flags
(``end_key``, ``("next", "done")`` by default) along the time dimension. So a
TorchRL script's data often has no episode column. :class:`EpisodeColumn`
adds one before the rows are sent:

* the data has the table's ``episode_key``: taken as it is;
* it has the sampler's ``traj_key``: those ids are the episode ids;
* else ids are derived from the end flags, as :mod:`replay_proto.rows` does
  for ``[*envs, T]`` batches, along the last batch dimension (a ``[N]``
  TensorDict is one env of ``N`` steps): a new id after every step that
  ends. The ids of a trajectory that an extend leaves open go on in the next
  extend (an :class:`~replay_proto.rows.EpisodeTracker`), as consecutive
  storage positions do in TorchRL.

The column it adds is the buffer's, not the data's: samples leave it out
(:attr:`EpisodeColumn.added`).

Thread-safety: one writer (the tracker carries its open episodes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from replay_proto.rows import EpisodeTracker, episode_ids

DEFAULT_END_KEYS: tuple[Any, ...] = (("next", "done"), ("next", "truncated"))
"""What ends a trajectory when the sampler names no ``end_key``: TorchRL's transition flags."""

COLLECTOR_TRAJ_KEY = ("collector", "traj_ids")
"""Trajectory ids as TorchRL's collectors write them: what its ``SliceSampler`` uses when
given neither ``traj_key`` nor ``end_key``."""


def _key(flat: str) -> Any:
    """A flat column name as a TensorDict key (``"next.done"`` -> ``("next", "done")``)."""
    parts = tuple(flat.split("."))
    return parts if len(parts) > 1 else parts[0]


class EpisodeColumn:
    """Adds the table's episode column to data that lacks one (see the module docstring).

    Args:
        episode_key: the table's episode column (flat name).
        traj_key: the column of trajectory ids the sampler names (flat), if any.
        end_keys: flag columns whose True ends a trajectory.
        find_traj_key: take :data:`COLLECTOR_TRAJ_KEY` as ``traj_key`` if the first data
            written has it (TorchRL's ``SliceSampler`` given neither key does so).
    """

    def __init__(self, episode_key: str, traj_key: str | None = None,
                 end_keys: Sequence[Any] = DEFAULT_END_KEYS, find_traj_key: bool = False
                 ) -> None:
        self.column = episode_key
        """The column's flat name (as samples' columns name it)."""
        self.key = _key(episode_key)
        self.traj_key = None if traj_key is None else _key(traj_key)
        self._find_traj_key = find_traj_key and traj_key is None
        self.end_keys = tuple(_key(k) if isinstance(k, str) else k for k in end_keys)
        self.added = False
        """Whether the column was added by the buffer (then samples leave it out)."""
        self._tracker = EpisodeTracker()

    def fill(self, data: TensorDictBase) -> TensorDictBase:
        """``data`` with the episode column (a shallow copy when one is added)."""
        keys = data.keys(include_nested=True, leaves_only=True)
        if self._find_traj_key:
            self._find_traj_key = False  # decided once, on the first data, as TorchRL does
            if COLLECTOR_TRAJ_KEY in keys:
                self.traj_key = COLLECTOR_TRAJ_KEY
        if self.key in keys:
            return data
        lead = tuple(data.batch_size)
        if not lead:
            data, lead = data.unsqueeze(0), (1,)
        if self.traj_key is not None and self.traj_key in keys:
            ids = data.get(self.traj_key).to(torch.int64)
            ids = ids.reshape(*lead, -1)[..., 0]
        else:
            envs, steps = math.prod(lead[:-1]), lead[-1]
            ends = np.zeros((envs, steps), dtype=bool)
            for key in self.end_keys:
                if key in keys:
                    flag = data.get(key).detach().cpu().reshape(envs, steps, -1)
                    ends |= flag.to(torch.bool).any(-1).numpy()
            ids = torch.from_numpy(episode_ids(ends, self._tracker)).reshape(lead)
        self.added = True
        out = data.copy()
        out.set(self.key, ids)
        return out

    def strip(self, columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A sample's columns (by flat name) without the episode column, when the buffer
        added it (before they become a TensorDict: a plain dict costs less to cut)."""
        if self.added and self.column in columns:
            return {name: value for name, value in columns.items() if name != self.column}
        return columns
