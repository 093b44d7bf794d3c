"""What a row is: a TensorDict's batch dimensions decide, and how episodes stay apart.

Plain mappings are rows along their leading dimension, as always. A
TensorDict (duck typed: tensordict stays optional for the wire) says itself
what its rows are, through its ``batch_size``:

* ``[]``: one row (a single transition, as TorchRL's ``add`` takes it);
* ``[N]``: ``N`` rows;
* ``[n_envs, T]`` (more generally ``[*envs, T]``: the last batch dimension is
  time, as in a TorchRL collector's output): ``n_envs * T`` rows, stored env
  by env, each env's ``T`` steps consecutive and in time order (row
  ``e * T + t`` is env ``e``'s step ``t``). Dimensions of a leaf beyond the
  batch dimensions are the row's own shape.

Episodes of a ``[*envs, T]`` batch. A slice table keeps an episode's steps
together by their episode id (the ``episode`` key by default), so the envs of
one batch must not share one:

* with an ``episode`` key in the TensorDict, its ids are taken as they are
  (reshaped like every other key);
* without one, an ``episode`` column is added: each env row gets a random
  62-bit id, and a new one after every step that ends an episode. The end of
  a step is read from ``("next", "done")`` and ``("next", "truncated")`` when
  the TensorDict has a ``"next"`` entry (TorchRL's convention: the flags of
  the transition), else from the root ``"done"`` and ``"truncated"``; keys
  that are absent count as False, so with none of them every env row is one
  episode. Ids are fresh per insert unless an :class:`EpisodeTracker` is
  given (``RemoteReplayBuffer`` keeps one): then an env whose last step did
  not end an episode goes on with the same id in the next batch, so episodes
  that span collector batches stay whole.

Thread-safety: pure functions; an :class:`EpisodeTracker` belongs to one writer.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np
import torch

from replay_proto.keys import KEY_SEPARATOR, flatten, is_tensordict

EPISODE_KEY = "episode"
"""Default column of episode ids (a table's ``episode_key`` default too)."""

_TRANSITION_ENDS = ("next.done", "next.truncated")
_STEP_ENDS = ("done", "truncated")


class EpisodeTracker:
    """Episode ids of a writer's env rows, carried from one ``[*envs, T]`` batch to the next.

    Attributes:
        ids: int64 ``[n_env_rows]``: the id each env row's next step gets.
    """

    def __init__(self) -> None:
        self.ids: np.ndarray | None = None

    def start(self, envs: int) -> np.ndarray:
        """The first id of each env row of the next batch (fresh ones when ``envs`` changed)."""
        if self.ids is None or self.ids.shape[0] != envs:
            self.ids = _fresh_ids(envs)
        return self.ids

    def finish(self, last_ids: np.ndarray, last_ended: np.ndarray) -> None:
        """Record each env row's last id, and whether its last step ended the episode."""
        ids = last_ids.copy()
        ended = np.flatnonzero(last_ended)
        if ended.size:
            ids[ended] = _fresh_ids(ended.size)
        self.ids = ids


def rows_of(data: Any, *, episode_key: str = EPISODE_KEY,
            tracker: EpisodeTracker | None = None) -> dict[str, Any]:
    """``data`` as flat columns whose leading dimension is rows (see the module docstring).

    Args:
        data: a mapping (rows along the leading dim) or a TensorDict (rows per its batch dims).
        episode_key: the column of episode ids a ``[*envs, T]`` TensorDict gets when it lacks one.
        tracker: carries env rows' episode ids across calls (``None``: fresh ids per call).

    Raises:
        TypeError, ValueError: as :func:`~replay_proto.keys.flatten`.
    """
    if not is_tensordict(data):
        return flatten(data)
    dims = len(data.batch_size)
    if dims == 0:
        return flatten(data.unsqueeze(0))
    if dims == 1:
        return flatten(data)
    envs, steps = math.prod(data.batch_size[:-1]), int(data.batch_size[-1])
    columns = flatten(data.reshape(-1))
    if episode_key not in columns and envs * steps:
        columns[episode_key] = torch.from_numpy(
            _episode_ids(columns, envs, steps, tracker).reshape(-1))
    return columns


def _episode_ids(columns: dict[str, Any], envs: int, steps: int,
                 tracker: EpisodeTracker | None) -> np.ndarray:
    """int64 ``[envs, steps]``: each env row's ids, a new one after every step that ends."""
    return episode_ids(_ends(columns, envs, steps), tracker)


def episode_ids(ends: np.ndarray, tracker: EpisodeTracker | None = None) -> np.ndarray:
    """int64 ``[envs, steps]`` episode ids of env rows whose steps end where ``ends`` (bool
    ``[envs, steps]``) is True: a new id after every step that ends, fresh 62-bit ids, each
    env row going on with its id in ``tracker`` (if given) and leaving its next one there."""
    envs, steps = ends.shape
    start = tracker.start(envs) if tracker is not None else _fresh_ids(envs)
    # Step t of an env belongs to the episode after the ends before it.
    before = np.zeros((envs, steps), dtype=np.int64)
    np.cumsum(ends[:, :-1], axis=1, out=before[:, 1:])
    ids = _fresh_ids(envs, steps + 1)  # one candidate id per possible episode of each env row
    ids[:, 0] = start
    out = np.take_along_axis(ids, before, axis=1)
    if tracker is not None:
        tracker.finish(out[:, -1], ends[:, -1])
    return out


def _ends(columns: dict[str, Any], envs: int, steps: int) -> np.ndarray:
    """bool ``[envs, steps]``: whether each step ends its episode (see the module docstring)."""
    has_next = any(key.startswith("next" + KEY_SEPARATOR) for key in columns)
    ends = np.zeros((envs, steps), dtype=bool)
    for key in _TRANSITION_ENDS if has_next else _STEP_ENDS:
        flag = columns.get(key)
        if flag is None:
            continue
        value = torch.as_tensor(flag).detach().cpu().reshape(envs, steps, -1)
        ends |= value.to(torch.bool).any(-1).numpy()
    return ends


def _fresh_ids(*shape: int) -> np.ndarray:
    """Random 62-bit ids (as the Writer's): unique across actors with overwhelming probability.

    A generator seeded from the OS per call, so forked actors never share a sequence.
    """
    return np.random.default_rng(secrets.randbits(128)).integers(
        0, 1 << 62, size=shape, dtype=np.int64)
