"""RLlib's episodes as a table's rows, and a sampled batch's rows as RLlib's episodes.

The RLlib buffers of :mod:`replay_server.ray` store one row per timestep
``t`` of a ``SingleAgentEpisode`` (for a multi-agent episode, of each agent's
single-agent episode): ``obs`` (o_t), ``action`` (a_t), ``reward`` (r_t),
``next.obs`` (o_t+1), ``done``/``truncated`` (set on an episode's last step),
``episode`` (the episode's id as an int64, :func:`episode_number`) and ``t``.
A sampled batch comes back as what RLlib's prioritized buffers return: one
one-step ``SingleAgentEpisode`` ``(o_t, a_t, R, o_t+n)`` per row, with
``weights`` and ``n_step`` in its ``extra_model_outputs``.

Cost: one pass over the steps (rows) given; the arrays are copied once.
Thread-safety: pure functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from replay_proto.batch import STEPS_KEY  # the column an n-step table adds

_EPISODE_BITS = (1 << 63) - 1

EpisodeFields = Callable[[int], Mapping[str, Any]]
"""Episode number -> the keywords of the ``SingleAgentEpisode``s made of its rows
(``id_``; for a multi-agent episode's agent also ``agent_id``, ``module_id`` and
``multi_agent_episode_id``)."""


def episode_number(episode_id: str) -> int:
    """RLlib's episode id (a string) as the int64 the table keys episodes by: the first 63
    bits of its BLAKE2b digest (the same in every process, so chunks of one episode added
    by different calls stay one episode)."""
    digest = hashlib.blake2b(str(episode_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _EPISODE_BITS


def rows_of(episodes: Sequence[Any]) -> dict[str, Any]:
    """The rows of ``episodes``' timesteps (``SingleAgentEpisode``s, none empty), as columns.

    Raises:
        TypeError: an observation that is not an array (a dict or tuple space).
    """
    parts: dict[str, list[Any]] = {k: [] for k in ("obs", "next", "action", "reward", "done",
                                                    "truncated", "episode", "t")}
    for episode in episodes:
        steps = len(episode)
        observations = np.asarray(episode.get_observations(slice(0, steps + 1)))
        if observations.dtype == object:
            raise TypeError("the RLlib buffers store array observations (a Box or Discrete "
                            "space), not dicts or tuples")
        parts["obs"].append(observations[:-1])
        parts["next"].append(observations[1:])
        parts["action"].append(np.asarray(episode.get_actions(slice(0, steps))))
        parts["reward"].append(np.asarray(episode.get_rewards(slice(0, steps)),
                                          dtype=np.float32))
        last = np.zeros(steps, dtype=bool)
        last[-1] = True
        parts["done"].append(last & bool(episode.is_terminated))
        parts["truncated"].append(last & bool(episode.is_truncated))
        parts["episode"].append(np.full(steps, episode_number(episode.id_), dtype=np.int64))
        parts["t"].append(np.arange(episode.t_started, episode.t_started + steps,
                                    dtype=np.int64))
    joined: dict[str, Any] = {k: torch.from_numpy(np.ascontiguousarray(np.concatenate(v)))
                              for k, v in parts.items()}
    joined["next"] = {"obs": joined["next"]}
    return joined


def episodes_of(batch: Any, fields: EpisodeFields,
                spaces: tuple[Any, Any]) -> list[SingleAgentEpisode]:
    """One one-step ``SingleAgentEpisode`` per row of a sampled ``batch``, in its order.

    Args:
        batch: a ``SampleBatch`` of a table these rows were stored in (a stream's batch is a
            view of its ring: the arrays are copied here).
        fields: the episodes' identifying keywords, by episode number.
        spaces: the observation and action spaces the episodes carry.
    """
    columns = batch.columns
    steps = columns.get(STEPS_KEY)
    n = (steps.tolist() if steps is not None else [1] * len(batch.ids))
    obs, next_obs = columns["obs"].numpy().copy(), columns["next.obs"].numpy().copy()
    action, reward = columns["action"].numpy().copy(), columns["reward"].numpy()
    done, truncated = columns["done"].tolist(), columns["truncated"].tolist()
    t, weights = columns["t"].tolist(), batch.weights.tolist()
    numbers = columns["episode"].tolist()
    observation_space, action_space = spaces
    return [SingleAgentEpisode(
        **fields(numbers[i]), observations=[obs[i], next_obs[i]],
        observation_space=observation_space, actions=[action[i]], action_space=action_space,
        rewards=[float(reward[i])], terminated=bool(done[i]),
        truncated=bool(truncated[i]) and not bool(done[i]),
        extra_model_outputs={"weights": [weights[i]], "n_step": [int(n[i])]},
        len_lookback_buffer=0, t_started=int(t[i])) for i in range(len(weights))]
