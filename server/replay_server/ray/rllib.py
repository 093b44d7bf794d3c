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

**Adds wait for no round trip** (``pending_adds``, default 4: a failed
background insert is raised by the next ``add`` or :meth:`flush` as
``WriterError``; bad episodes are still refused by the ``add`` that brought
them) and **samples come from a stream** (``prefetch``, default 2: the
priority updates ride on its credits, so a training step waits on no sample
and no update round trip; with RLlib's DQN on CartPole the buffer's waiting
round trips per step had held it at 0.58x RLlib's own buffer's env steps/s,
without them 2.33x: docs/benchmarks.md). Both are the buffer's table's
(:class:`~replay_server.ray.rllib_table.BufferTable`, which says what they
cost); ``prefetch=0`` and ``pending_adds=0`` make a waiting call of each,
in RLlib's own order. :meth:`flush` stores the adds and applies the updates
still on their way (:meth:`get_state` and :meth:`close` do first).

What differs from RLlib's buffer, by design: the capacity counts rows
(timesteps) and the oldest rows are overwritten first, row by row, where
RLlib evicts whole episodes. The algorithm's own process passes the
episodes through (``add`` in the driver), so the rows cross the network
once more, unless the env runners write to the shards themselves
(:class:`~replay_server.ray.rllib_env_runner.ShardedEnvRunner`): ``add``
then takes their :class:`~replay_server.ray.rllib_written.WrittenEpisode`
counts and sends nothing (``rows_sent`` against
``rows_written_by_env_runners``). Likewise on the way out: with
``learners_draw``, :meth:`sample` returns draw orders and each learner
(:class:`~replay_server.ray.rllib_learner.ShardedDQNTorchLearner`) draws its
share from the shards itself (:mod:`~replay_server.ray.rllib_draws`).
Single-agent only (``MultiAgentEpisode``s are refused: see
:mod:`~replay_server.ray.rllib_multi`); stateful modules
(``batch_length_T > 1``), ``include_infos`` and ``include_extra_model_outputs``
are refused by name.

Thread-safety: as RLlib's buffer, one caller at a time (the algorithm's
training step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)

from replay_proto.batch import STEPS_KEY  # the column an n-step table adds
from replay_server.ray.cluster import DEFAULT_NAMESPACE, ReplayCluster
from replay_server.ray.rllib_draws import DrawSpec, draw_rows
from replay_server.ray.rllib_episodes import EpisodeWindow
from replay_server.ray.rllib_written import WriteFailure, WrittenEpisode
from replay_server.ray.rllib_rows import episode_number, episodes_of, rows_of
from replay_server.ray.rllib_table import (
    BufferTable,
    check_options,
    check_sample_args,
    open_replay,
    table_entry,
)

__all__ = ["ShardedEpisodeReplayBuffer", "episode_number"]


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
        learners_draw: :meth:`sample` returns draw orders, not rows: the learners
            (:class:`~replay_server.ray.rllib_learner.ShardedDQNTorchLearner`) draw their
            shares from the shards themselves (see the module docstring).

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
                 pending_adds: int = 4, learners_draw: bool = False, **kwargs: Any) -> None:
        EpisodeReplayBuffer.__init__(  # not the parent's: its segment trees stay unused
            self, capacity=capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
            metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        check_options(batch_length_T=batch_length_T, n_step=n_step, prefetch=prefetch,
                      pending_adds=pending_adds)
        self._alpha = float(alpha)
        self._n_step, self._gamma = n_step, float(gamma)
        # episode number -> RLlib's id, for the episodes of the last `capacity` rows added
        self._episodes: EpisodeWindow[int, str] = EpisodeWindow(capacity)
        self._spaces: tuple[Any, Any] = (None, None)
        entry = table_entry(table, capacity=capacity, num_shards=num_shards, alpha=self._alpha,
                            beta=float(beta), n_step=n_step, gamma=self._gamma)
        self._cluster, self._client = open_replay(
            [entry], replay=replay, num_shards=num_shards, namespace=namespace,
            checkpoint_dir=checkpoint_dir, checkpoint_interval_s=checkpoint_interval_s,
            shard_options=shard_options, address=address, client_options=client_options)
        self._estimating = False  # inside add(): get_num_timesteps estimates (see there)
        self._rows = BufferTable(self._client, table, beta=beta, prefetch=prefetch,
                                 pending_adds=pending_adds)
        self._rows.check()
        self.rows_sent = 0  # rows this buffer's add inserted itself
        self.learners_draw = bool(learners_draw)
        self._draw: dict[str, Any] = {  # what a learner's reader needs (learners_draw)
            "capacity": int(capacity), "alpha": self._alpha, "n_step": n_step,
            "gamma": self._gamma, "client_options": dict(client_options or {}),
            "prefetch": prefetch}
        self.rows_written_by_env_runners = 0  # rows ShardedEnvRunners inserted (counted here)

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
        :class:`~replay_server.ray.rllib_written.WrittenEpisode`s (what
        ``ShardedEnvRunner``s return: rows they inserted themselves) are counted, not sent
        (``weight`` does not apply to them: the shards give the largest priority seen).

        Raises:
            TypeError: a multi-agent episode or an observation that is not an array.
            ValueError: a bad ``weight``; nothing stored.
            WriterError: an earlier add's background insert failed, or an env runner's
                (a ``WriteFailure`` among ``episodes``: raised after the rest was added).
        """
        given = episodes if isinstance(episodes, list) else [episodes]
        for episode in given:
            if not isinstance(episode, (SingleAgentEpisode, WrittenEpisode, WriteFailure)):
                raise TypeError(f"ShardedEpisodeReplayBuffer stores SingleAgentEpisodes, got "
                                f"{type(episode).__name__} (multi-agent: replay_server.ray."
                                f"rllib_multi.ShardedMultiAgentEpisodeReplayBuffer)")
        failed = [e for e in given if isinstance(e, WriteFailure)]
        listed = [e for e in given if len(e) > 0]
        if listed:
            self._add_listed(listed, weight)
        if failed:  # an env runner's insert failed: raised here, in the driver
            raise failed[0].error()

    def _add_listed(self, listed: list[Any], weight: float | None) -> None:
        """Insert the rows of the episodes of ``listed`` and count those the env runners
        wrote; RLlib's add metrics for both."""
        sent = [e for e in listed if isinstance(e, SingleAgentEpisode)]
        written = [e for e in listed if isinstance(e, WrittenEpisode)]
        if sent:
            rows = rows_of(sent)
            steps = len(rows["t"])
            self._rows.add(rows, steps, weight)
            self.rows_sent += steps
        if written:  # stored by the env runners: counted, nothing sent
            steps = sum(e.steps for e in written)
            self._rows.count_written(steps)
            self.rows_written_by_env_runners += steps
            self.metrics.log_value("num_env_steps_written_by_env_runners", steps, reduce="sum")
        if self._spaces == (None, None):
            self._spaces = _spaces_of(listed)
        new = []  # episodes not seen before (a later chunk of one continues it, as in RLlib)
        for episode in listed:
            if self._episodes.add(episode_number(episode.id_), episode.id_, len(episode)):
                new.append(episode)
        steps = sum(len(e) for e in listed)
        self._num_timesteps_added += steps
        agent_steps = sum(e.agent_steps() if isinstance(e, SingleAgentEpisode)
                          else e.agent_steps for e in listed)
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
        check_sample_args(n_step_stored=self._n_step, gamma_stored=self._gamma,
                          batch_length_T=batch_length_T, n_step=n_step, gamma=gamma,
                          include_infos=include_infos,
                          include_extra_model_outputs=include_extra_model_outputs)
        if self.learners_draw:  # the learners draw the rows (rllib_learner.py)
            return self._order(int(size), beta)
        batch = self._rows.draw(int(size), beta)
        episodes = episodes_of(batch, self._fields, self._spaces)
        if to_numpy:
            for episode in episodes:
                episode.to_numpy()
        self.sampled_timesteps += len(episodes)
        self._log_sample(batch, episodes)
        return episodes

    def _order(self, size: int, beta: float | None) -> list[Any]:
        """``size`` draw orders for the learners (``learners_draw``), counted as sampled."""
        spec = DrawSpec(address=self._client_address(), table=self._rows.name,
                        beta=self._rows.beta if beta is None else float(beta),
                        spaces=self._spaces, **self._draw)
        self.sampled_timesteps += size
        self.metrics.log_value("num_rows_ordered_from_learners", size, reduce="sum")
        return draw_rows(size, spec)

    def set_spaces(self, spaces: tuple[Any, Any]) -> None:
        """The observation and action spaces of the episodes :meth:`sample` returns, where
        this buffer added none itself (a learner's reader: ``learners_draw``)."""
        if self._spaces == (None, None):
            self._spaces = spaces

    def _fields(self, number: int) -> dict[str, Any]:
        return {"id_": self._episodes.get(number) or f"{number:016x}"}

    def flush(self) -> None:
        """Store the adds on their way, apply the priority updates still riding on the
        sample stream, and close it (the next :meth:`sample` opens another).

        Raises:
            WriterError: an add on its way failed (see the module docstring).
        """
        self._rows.flush()

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
        stale = self._rows.update(values)
        if stale is not None:
            self.metrics.log_value("num_priorities_stale", stale, reduce="sum")
        if len(values):
            self.metrics.log_value("num_priorities_updated", len(values), reduce="sum")

    def get_num_timesteps(self, module_id: Any = None) -> int:
        """Rows stored now, over every shard (the adds on their way stored first).

        Within :meth:`add`, where RLlib's add metrics ask it for their smoothed
        ``num_env_steps_stored``, an estimate without a round trip: the size last read
        here plus the rows added since, at most the capacity (rows other writers put in
        the replay meanwhile are not in it)."""
        if self._estimating:
            return min(int(self.capacity), self._rows.size(estimate=True))
        return self._rows.size()

    def get_num_episodes(self, module_id: Any = None) -> int:
        """Episodes this buffer has added (rows of one may since have been overwritten)."""
        return self._episodes.added

    def get_state(self) -> dict[str, Any]:
        """A checkpoint of every shard now and this buffer's counters: ``{"replay",
        "table", "checkpoints": {shard: path}, ...}`` (what RLlib keeps in its algorithm
        checkpoint)."""
        self.flush()  # the updates on their way belong in the checkpoint
        checkpoints = self._client.checkpoint()
        if isinstance(checkpoints, str):
            checkpoints = {0: checkpoints}
        return {"replay": self._client_address(), "table": self._rows.name,
                "checkpoints": dict(checkpoints), "max_priority": self._rows.max_priority,
                "num_timesteps_added": self._num_timesteps_added,
                "sampled_timesteps": self.sampled_timesteps,
                "episodes": self._episodes.state()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`get_state`'s counters. The rows are the replay's: its shards
        restore them from ``checkpoint_dir`` when they start, not this call.

        Raises:
            ValueError: ``state`` is another replay's or table's (named).
        """
        table = self._rows.name
        if state.get("table") != table or state.get("replay") != self._client_address():
            raise ValueError(f"set_state: the state is of table {state.get('table')!r} of "
                             f"{state.get('replay')!r}, this buffer's is {table!r} of "
                             f"{self._client_address()!r}")
        self._rows.max_priority = float(state["max_priority"])
        self._num_timesteps_added = int(state["num_timesteps_added"])
        self.sampled_timesteps = int(state["sampled_timesteps"])
        if "episodes" in state:
            self._episodes.restore(state["episodes"]["episodes"], state["episodes"]["added"])
        else:  # a state saved before the window (every id, no row counts)
            ids = list(state.get("episode_ids", []))
            self._episodes.restore([(episode_number(i), i, 1) for i in ids], len(ids))

    def _client_address(self) -> str:
        return self._cluster.address if self._cluster is not None else str(
            getattr(self._client, "address", ""))

    def close(self) -> None:
        """Close the sample stream (its updates applied) and the client (the replay keeps
        running: ``buffer.cluster.shutdown()`` stops it)."""
        try:
            self._rows.close()
        finally:
            self._client.close()


def _spaces_of(episodes: list[Any]) -> tuple[Any, Any]:
    """The observation and action spaces the first of ``episodes`` that carries them has
    (``(None, None)`` where none does)."""
    for episode in episodes:
        if isinstance(episode, SingleAgentEpisode):
            return episode.observation_space, episode.action_space
        if episode.spaces is not None:
            return episode.spaces
    return None, None
