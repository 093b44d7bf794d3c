"""``ShardedEpisodeReplayBuffer``: RLlib's prioritized episode buffer, its rows in a replay's shards.

An RLlib user swaps DQN's (or any new-API-stack off-policy algorithm's)
buffer by naming this class by its dotted path (RLlib 2.60 crashes on a
class object there)::

    config.training(replay_buffer_config={
        "type": "replay_server.ray.rllib.ShardedEpisodeReplayBuffer",
        "capacity": 50_000, "alpha": 0.6, "beta": 0.4,
        "replay": "dqn", "num_shards": 2,          # ReplayCluster.create(get_if_exists=True)
    })

It subclasses RLlib's ``PrioritizedEpisodeReplayBuffer`` (so the algorithm
sends it the learner's TD errors) and keeps that class's contract:

* :meth:`add` takes ``SingleAgentEpisode``s (whole episodes or chunks of
  running ones, in any order) and stores one row per timestep ``t``:
  ``obs`` (o_t), ``action`` (a_t), ``reward`` (r_t), ``next.obs`` (o_t+1),
  ``done``/``truncated`` (set on an episode's last step), ``episode`` (the
  episode's id as an int64) and ``t``. New rows get the largest priority
  seen so far (or ``weight``), as RLlib's buffer gives them.
* :meth:`sample` draws ``num_items`` rows by priority, exact over every
  shard, and returns what RLlib's returns: one-step ``SingleAgentEpisode``s
  ``(o_t, a_t, R, o_t+n)`` with ``weights`` (``(N P(i))^-beta / max_j w_j``
  over the whole replay) and ``n_step`` in their ``extra_model_outputs``.
  With ``n_step > 1`` the table builds the n-step return at sample time
  (``R = sum_k gamma^k r_t+k``); where an episode ends first it stops there
  and says so in ``n_step`` (TorchRL's ``MultiStep``; RLlib draws again).
* :meth:`update_priorities` sets the priorities of the rows the last
  :meth:`sample` returned, by their ids: an id whose row has since been
  overwritten is ignored (counted by the shard), never applied to a newer row.
* :meth:`get_metrics` is RLlib's (the add and sample metrics are logged
  into the buffer's ``MetricsLogger`` as RLlib's buffer logs them).
* :meth:`get_state` checkpoints every shard and returns the checkpoints'
  paths and the buffer's counters (RLlib keeps that in its algorithm
  checkpoint); :meth:`set_state` takes the counters back: the rows are the
  replay's, restored by its shards from ``checkpoint_dir`` when they start.

**Adds wait for no round trip** (``pending_adds``, default 4): each insert
goes to the shards from a background thread, in order, while the algorithm
samples and trains (:mod:`~replay_server.ray.pending_adds`); a failed one is
raised by the next ``add`` (or :meth:`flush`) as ``WriterError``. Bad
episodes are still refused by the ``add`` that brought them. ``pending_adds=0``
waits for each insert.

**Samples come from a stream** (``prefetch``, default 2): the first
:meth:`sample` opens a learner stream of that batch size over every shard
(merged exactly, as ``client.stream``), which draws up to ``prefetch`` batches
ahead while the algorithm trains; :meth:`sample` takes the next one, and
:meth:`update_priorities` rides on the stream's next credit. So a training
step waits on no sample and no update round trip (with RLlib's DQN on
CartPole the buffer's waiting round trips per step had held it at 0.58x
RLlib's own buffer's env steps/s; without them 2.33x: docs/benchmarks.md).
What that costs, as with Reverb's datasets: a batch may have been drawn
before the last ``prefetch`` updates were applied. ``prefetch=0`` draws
each sample by a call and waits for each update (RLlib's own order, one round
trip each). Another batch size or ``beta`` reopens the stream; :meth:`flush`
stores the adds and applies the updates still on their way (:meth:`get_state`
and :meth:`close` do first).

What differs from RLlib's buffer, by design: the capacity counts rows
(timesteps) and the oldest rows are overwritten first, row by row, where
RLlib evicts whole episodes; the algorithm's own process still passes the
episodes through (``add`` in the driver), so the rows cross the network
once more than with env runners writing to the shards themselves.
Single-agent only (``MultiAgentEpisode``s are refused); stateful modules
(``batch_length_T > 1``), ``include_infos`` and ``include_extra_model_outputs``
are refused by name.

Thread-safety: as RLlib's buffer, one caller at a time (the algorithm's
training step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)

from replay_client import ReplayClient
from replay_proto.batch import STEPS_KEY  # the column an n-step table adds
from replay_proto.scalars import is_int
from replay_server.errors import ConfigError
from replay_server.ray.cluster import DEFAULT_NAMESPACE, ReplayCluster
from replay_server.ray.pending_adds import PendingAdds

_EPISODE_BITS = (1 << 63) - 1


def episode_number(episode_id: str) -> int:
    """RLlib's episode id (a string) as the int64 the table keys episodes by: the first 63
    bits of its BLAKE2b digest (the same in every process, so chunks of one episode added
    by different calls stay one episode)."""
    digest = hashlib.blake2b(str(episode_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _EPISODE_BITS


class ShardedEpisodeReplayBuffer(PrioritizedEpisodeReplayBuffer):
    """RLlib's prioritized episode buffer over a replay's shards (see the module docstring).

    Args:
        capacity: rows (timesteps) the replay keeps, over all its shards (each
            shard's table holds ``ceil(capacity / num_shards)``).
        batch_size_B: rows :meth:`sample` draws when given no ``num_items``.
        batch_length_T: 1 (rows); longer sequences are refused.
        alpha: the priority exponent (RLlib's default 1.0; DQN sets 0.6).
        beta: the importance-weight exponent used until :meth:`sample` is given another.
        metrics_num_episodes_for_smoothing: the window of the averaged metrics (RLlib's).
        replay: the replay's name (a :class:`ReplayCluster`; made if it does not run,
            returned if it does, ``get_if_exists``).
        num_shards: its shards, where it is made here.
        table: the table's name in it.
        namespace: its Ray namespace.
        n_step, gamma: the n-step return the table builds at sample time (set DQN's
            ``n_step`` to the same int: another is refused at :meth:`sample`).
        checkpoint_dir, checkpoint_interval_s, shard_options: as
            :meth:`ReplayCluster.create`.
        address: a replay to use instead of making one (``ray://ns/name``, or shard
            addresses): its ``table`` must exist, prioritized.
        client_options: keywords of the ``ReplayClient`` (``allow_degraded``, ``timeout``...).
        prefetch: batches the sample stream draws ahead (see the module docstring); 0:
            a call per sample and a waiting call per update.
        pending_adds: inserts on their way at once (see the module docstring); 0: each
            ``add`` waits for its insert.

    Raises:
        ConfigError: a bad option (named), or a table of that name that is not prioritized.
        ReplayExistsError: the replay runs with another table config.
    """

    def __init__(self, capacity: int = 10000, *, batch_size_B: int = 16,
                 batch_length_T: int = 1, alpha: float = 1.0, beta: float = 0.4,
                 metrics_num_episodes_for_smoothing: int = 100, replay: str = "rllib",
                 num_shards: int = 1, table: str = "rllib",
                 namespace: str = DEFAULT_NAMESPACE, n_step: int = 1, gamma: float = 0.99,
                 checkpoint_dir: str | None = None, checkpoint_interval_s: float = 60.0,
                 shard_options: Any = None, address: str | None = None,
                 client_options: Mapping[str, Any] | None = None, prefetch: int = 2,
                 pending_adds: int = 4, **kwargs: Any) -> None:
        EpisodeReplayBuffer.__init__(  # not the parent's: its segment trees stay unused
            self, capacity=capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
            metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        if batch_length_T not in (0, 1):
            raise ConfigError(f"ShardedEpisodeReplayBuffer samples rows: batch_length_T must "
                              f"be 1, got {batch_length_T!r}")
        if not is_int(n_step) or n_step < 1:
            raise ConfigError(f"n_step must be an int >= 1 (the table's n-step return), got "
                              f"{n_step!r}")
        if not is_int(prefetch) or prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0 (batches drawn ahead; 0: a call "
                              f"per sample), got {prefetch!r}")
        if not is_int(pending_adds) or pending_adds < 0:
            raise ConfigError(f"pending_adds must be an int >= 0 (inserts on their way; 0: "
                              f"each add waits), got {pending_adds!r}")
        self._prefetch = int(prefetch)
        self._stream: Any = None  # the sample stream (prefetch > 0), opened by sample()
        self._stream_size = 0
        self._alpha, self._beta = float(alpha), float(beta)
        self._max_priority = 1.0
        self._n_step, self._gamma, self._table = n_step, float(gamma), table
        self._last_sampled_ids = torch.empty(0, dtype=torch.int64)
        self._episode_ids: dict[int, str] = {}  # episode number -> RLlib's id
        self._spaces: tuple[Any, Any] = (None, None)
        self._cluster: ReplayCluster | None = None
        if address is None:
            self._cluster = ReplayCluster.create(
                replay, tables=[self._table_entry(capacity, num_shards)], num_shards=num_shards,
                checkpoint_dir=checkpoint_dir, checkpoint_interval_s=checkpoint_interval_s,
                shard_options=shard_options, namespace=namespace, get_if_exists=True)
            self._client = self._cluster.client(**dict(client_options or {}))
        else:
            self._client = ReplayClient(address, **dict(client_options or {}))
        self._estimating = False  # inside add(): get_num_timesteps estimates (see there)
        self._size_read = self._added_since_read = 0
        self._check_table()
        self._client.set_sampling(table, beta=self._beta)
        self._adds = (PendingAdds(self._client, table, int(pending_adds)) if pending_adds
                      else None)

    def _table_entry(self, capacity: int, num_shards: int) -> dict[str, Any]:
        per_shard = -(-int(capacity) // max(1, int(num_shards)))
        return {"name": self._table, "capacity": per_shard, "sampler": "prioritized",
                "alpha": self._alpha, "beta": self._beta, "n_step": self._n_step,
                "gamma": self._gamma}

    def _check_table(self) -> None:
        info = self._client.info()
        if self._table not in info:
            raise ConfigError(f"the replay has no table {self._table!r} (it has "
                              f"{sorted(info)}): name one with table=")
        if info[self._table].sampler != "prioritized":
            raise ConfigError(f"table {self._table!r} samples {info[self._table].sampler!r}; "
                              f"ShardedEpisodeReplayBuffer needs a 'prioritized' one")
        self._size_read = int(info[self._table].size)  # a running replay's rows count too

    # ------------------------------------------------------------ what RLlib calls

    @property
    def client(self) -> Any:
        """The ``ReplayClient`` the rows go through (pass it to env runners and learners)."""
        return self._client

    @property
    def cluster(self) -> ReplayCluster | None:
        """The replay made or found at construction (``None`` where ``address=`` named one)."""
        return self._cluster

    def __len__(self) -> int:
        return self.get_num_timesteps()

    def add(self, episodes: Any,  # type: ignore[override]  # RLlib's parent's own signature
            weight: float | None = None) -> None:
        """Store every timestep of ``episodes`` (one ``SingleAgentEpisode`` or a list) as a
        row; ``weight``: their priority (default: the largest seen so far, as RLlib's).

        Raises:
            TypeError: a multi-agent episode or an observation that is not an array.
            ValueError: a bad ``weight``; nothing stored.
        """
        given = episodes if isinstance(episodes, list) else [episodes]
        for episode in given:
            if not isinstance(episode, SingleAgentEpisode):
                raise TypeError(f"ShardedEpisodeReplayBuffer stores SingleAgentEpisodes, got "
                                f"{type(episode).__name__} (multi-agent is not supported)")
        listed = [e for e in given if len(e) > 0]
        if not listed:
            return
        rows = _rows_of(listed)
        if self._spaces == (None, None):
            self._spaces = (listed[0].observation_space, listed[0].action_space)
        priorities = None
        if weight is not None:
            priorities = torch.full((len(rows["t"]),), float(weight), dtype=torch.float64)
        if self._adds is not None:
            self._adds.put(rows, priorities, len(rows["t"]))
        else:
            self._client.insert(self._table, rows, priorities=priorities)
        new = []  # episodes not seen before (a later chunk of one continues it, as in RLlib)
        for episode in listed:
            if episode_number(episode.id_) not in self._episode_ids:
                self._episode_ids[episode_number(episode.id_)] = episode.id_
                new.append(episode)
        steps = len(rows["t"])
        self._num_timesteps_added += steps
        self._added_since_read += steps
        agent_steps = sum(e.agent_steps() for e in listed)
        self._estimating = True  # RLlib's add metrics ask the size: no round trip per add
        try:
            self._log_add(new, steps, agent_steps)
        finally:
            self._estimating = False

    def _log_add(self, new: list[Any], steps: int, agent_steps: int) -> None:
        self._update_add_metrics(
            num_episodes_added=len(new), num_env_steps_added=steps, num_episodes_evicted=0,
            num_env_steps_evicted=0, agent_to_num_episodes_added={DEFAULT_AGENT_ID: len(new)},
            agent_to_num_steps_added={DEFAULT_AGENT_ID: agent_steps},
            agent_to_num_episodes_evicted={DEFAULT_AGENT_ID: 0},
            agent_to_num_steps_evicted={DEFAULT_AGENT_ID: 0},
            module_to_num_episodes_added={DEFAULT_MODULE_ID: len(new)},
            module_to_num_steps_added={DEFAULT_MODULE_ID: agent_steps},
            module_to_num_episodes_evicted={DEFAULT_MODULE_ID: 0},
            module_to_num_steps_evicted={DEFAULT_MODULE_ID: 0})

    def sample(self,  # type: ignore[override]  # RLlib's annotation; its buffer returns this
               num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: Any = None, beta: float | None = None,
               gamma: float | None = None, include_infos: bool = False,
               include_extra_model_outputs: bool = False, to_numpy: bool = False,
               **kwargs: Any) -> list[SingleAgentEpisode]:
        """``num_items`` transitions drawn by priority over every shard, as RLlib's buffer
        returns them (see the module docstring); their ids are kept for
        :meth:`update_priorities`.

        Raises:
            ValueError: an argument this buffer cannot honour (named, with what to set).
        """
        if num_items is not None and batch_size_B is not None:
            raise ValueError("sample(): give num_items or batch_size_B, not both")
        size = num_items or batch_size_B or self.batch_size_B
        self._check_sample_args(batch_length_T, n_step, gamma, include_infos,
                                include_extra_model_outputs)
        if beta is not None and float(beta) != self._beta:
            self.flush()  # the stream's batches are drawn with the old beta
            self._client.set_sampling(self._table, beta=float(beta))
            self._beta = float(beta)
        batch = self._draw(int(size))
        episodes = self._episodes_of(batch)
        if to_numpy:
            for episode in episodes:
                episode.to_numpy()
        self._last_sampled_ids = batch.ids.clone()
        self.sampled_timesteps += len(episodes)
        self._log_sample(batch, episodes)
        return episodes

    def _draw(self, size: int) -> Any:
        """The next batch of ``size`` rows: from the sample stream (opened, or reopened for
        another size, here), or by a call where ``prefetch`` is 0."""
        if self._prefetch == 0:  # RLlib's own order: the rows added before are drawn from
            self._wait_for_adds()
            return self._client.sample(self._table, size)
        if self._stream is not None and self._stream_size != size:
            self.flush()
        if self._stream is None:
            self._stream = self._client.stream(self._table, size, prefetch=self._prefetch)
            self._stream_size = size
        return next(self._stream)

    def flush(self) -> None:
        """Store the adds on their way, apply the priority updates still riding on the
        sample stream, and close it (the next :meth:`sample` opens another).

        Raises:
            WriterError: an add on its way failed (see the module docstring).
        """
        self._wait_for_adds()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _wait_for_adds(self) -> None:
        if self._adds is not None:
            self._adds.wait()

    def _check_sample_args(self, batch_length_T: int | None, n_step: Any,
                           gamma: float | None, include_infos: bool,
                           include_extra_model_outputs: bool) -> None:
        if batch_length_T not in (None, 0, 1):
            raise ValueError(f"sample(batch_length_T={batch_length_T}): this buffer samples "
                             f"rows (stateful modules need sequences: not supported)")
        if n_step is not None and n_step != self._n_step:
            raise ValueError(f"sample(n_step={n_step!r}): the table builds {self._n_step}-step "
                             f"returns; set replay_buffer_config's n_step to the algorithm's "
                             f"(an int) and use a new table or replay")
        if gamma is not None and self._n_step > 1 and float(gamma) != self._gamma:
            raise ValueError(f"sample(gamma={gamma}): the table discounts its n-step returns "
                             f"with gamma={self._gamma}; set replay_buffer_config's gamma")
        if include_infos or include_extra_model_outputs:
            raise ValueError("sample(): include_infos and include_extra_model_outputs are not "
                             "stored by this buffer")

    def _episodes_of(self, batch: Any) -> list[SingleAgentEpisode]:
        columns = batch.columns
        steps = columns.get(STEPS_KEY)
        n = (steps.tolist() if steps is not None else [1] * len(batch.ids))
        # copies: a stream's batch is a view of its ring, valid until the next batch
        obs, next_obs = columns["obs"].numpy().copy(), columns["next.obs"].numpy().copy()
        action, reward = columns["action"].numpy().copy(), columns["reward"].numpy()
        done, truncated = columns["done"].tolist(), columns["truncated"].tolist()
        t, weights = columns["t"].tolist(), batch.weights.tolist()
        names = [self._episode_ids.get(n, f"{n:016x}") for n in columns["episode"].tolist()]
        observation_space, action_space = self._spaces
        return [SingleAgentEpisode(
            id_=names[i], observations=[obs[i], next_obs[i]], observation_space=observation_space,
            actions=[action[i]], action_space=action_space, rewards=[float(reward[i])],
            terminated=bool(done[i]), truncated=bool(truncated[i]) and not bool(done[i]),
            extra_model_outputs={"weights": [weights[i]], "n_step": [int(n[i])]},
            len_lookback_buffer=0, t_started=int(t[i])) for i in range(len(weights))]

    def _log_sample(self, batch: Any, episodes: list[SingleAgentEpisode]) -> None:
        size = len(episodes)
        unique = len(set(batch.ids.tolist()))
        episodes_in = len(set(batch.columns["episode"].tolist()))
        steps = batch.columns.get(STEPS_KEY)
        mean_n = float(steps.double().mean()) if steps is not None else 1.0
        self._update_sample_metrics(
            num_env_steps_sampled=size, num_episodes_per_sample=episodes_in,
            num_env_steps_per_sample=unique, sampled_n_step=mean_n, num_resamples=0,
            agent_to_num_steps_sampled={DEFAULT_AGENT_ID: size},
            agent_to_num_episodes_per_sample={DEFAULT_AGENT_ID: episodes_in},
            agent_to_num_steps_per_sample={DEFAULT_AGENT_ID: unique},
            agent_to_sampled_n_step={DEFAULT_AGENT_ID: mean_n},
            agent_to_num_resamples={DEFAULT_AGENT_ID: 0},
            module_to_num_steps_sampled={DEFAULT_MODULE_ID: size},
            module_to_num_episodes_per_sample={DEFAULT_MODULE_ID: episodes_in},
            module_to_num_steps_per_sample={DEFAULT_MODULE_ID: unique},
            module_to_sampled_n_step={DEFAULT_MODULE_ID: mean_n},
            module_to_num_resamples={DEFAULT_MODULE_ID: 0})

    def update_priorities(self, priorities: Any, module_id: Any = None) -> None:
        """Set the priorities of the rows the last :meth:`sample` returned, in its order
        (RLlib's TD errors; values below 1e-12 are raised to it, as RLlib's buffer does).

        Raises:
            ValueError: not one priority per sampled row (or no sample since the last
                update), or a value that is not finite; nothing applied.
        """
        values = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if len(values) != len(self._last_sampled_ids):
            raise ValueError(f"update_priorities: {len(values)} priorities for the "
                             f"{len(self._last_sampled_ids)} rows of the last sample")
        if len(values) == 0:
            return
        values = np.maximum(values, 1e-12)
        if self._stream is not None:  # on the stream's next credit: no round trip
            self._stream.update_priorities(self._last_sampled_ids, torch.from_numpy(values))
        else:
            applied = self._client.update_priorities(self._table, self._last_sampled_ids,
                                                     torch.from_numpy(values))
            self.metrics.log_value("num_priorities_stale", len(values) - int(applied or 0),
                                   reduce="sum")
        self._max_priority = max(self._max_priority, float(values.max()))
        self.metrics.log_value("num_priorities_updated", len(values), reduce="sum")
        self._last_sampled_ids = torch.empty(0, dtype=torch.int64)

    def get_num_timesteps(self, module_id: Any = None) -> int:
        """Rows stored now, over every shard (the adds on their way stored first).

        Within :meth:`add`, where RLlib's add metrics ask it for their smoothed
        ``num_env_steps_stored``, an estimate without a round trip: the size last read
        here plus the rows added since, at most the capacity (rows other writers put in
        the replay meanwhile are not in it)."""
        if self._estimating:
            return min(int(self.capacity), self._size_read + self._added_since_read)
        self._wait_for_adds()
        self._size_read = int(self._client.info()[self._table].size)
        self._added_since_read = 0
        return self._size_read

    def get_num_episodes(self, module_id: Any = None) -> int:
        """Episodes this buffer has added (rows of one may since have been overwritten)."""
        return len(self._episode_ids)

    def get_state(self) -> dict[str, Any]:
        """A checkpoint of every shard now and this buffer's counters: ``{"replay",
        "table", "checkpoints": {shard: path}, ...}`` (what RLlib keeps in its algorithm
        checkpoint)."""
        self.flush()  # the updates on their way belong in the checkpoint
        checkpoints = self._client.checkpoint()
        if isinstance(checkpoints, str):
            checkpoints = {0: checkpoints}
        return {"replay": self._client_address(), "table": self._table,
                "checkpoints": dict(checkpoints), "max_priority": self._max_priority,
                "num_timesteps_added": self._num_timesteps_added,
                "sampled_timesteps": self.sampled_timesteps,
                "episode_ids": sorted(self._episode_ids.values())}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`get_state`'s counters. The rows are the replay's: its shards
        restore them from ``checkpoint_dir`` when they start, not this call.

        Raises:
            ValueError: ``state`` is another replay's or table's (named).
        """
        if state.get("table") != self._table or state.get("replay") != self._client_address():
            raise ValueError(f"set_state: the state is of table {state.get('table')!r} of "
                             f"{state.get('replay')!r}, this buffer's is {self._table!r} of "
                             f"{self._client_address()!r}")
        self._max_priority = float(state["max_priority"])
        self._num_timesteps_added = int(state["num_timesteps_added"])
        self.sampled_timesteps = int(state["sampled_timesteps"])
        self._episode_ids = {episode_number(i): i for i in state["episode_ids"]}

    def _client_address(self) -> str:
        return self._cluster.address if self._cluster is not None else str(
            getattr(self._client, "address", ""))

    def close(self) -> None:
        """Close the sample stream (its updates applied) and the client (the replay keeps
        running: ``buffer.cluster.shutdown()`` stops it)."""
        try:
            self.flush()
        finally:
            if self._adds is not None:
                self._adds.stop()
            self._client.close()


def _rows_of(episodes: Sequence[Any]) -> dict[str, Any]:
    """The rows of ``episodes``' timesteps (see the module docstring), as columns."""
    parts: dict[str, list[Any]] = {k: [] for k in ("obs", "next", "action", "reward", "done",
                                                    "truncated", "episode", "t")}
    for episode in episodes:
        steps = len(episode)
        observations = np.asarray(episode.get_observations(slice(0, steps + 1)))
        if observations.dtype == object:
            raise TypeError("ShardedEpisodeReplayBuffer stores array observations (a Box or "
                            "Discrete space), not dicts or tuples")
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
