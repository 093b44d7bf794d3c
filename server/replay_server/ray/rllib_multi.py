"""``ShardedMultiAgentEpisodeReplayBuffer``: RLlib's multi-agent prioritized buffer, one table per module.

An RLlib user with several modules (policies) swaps DQN's multi-agent buffer
by naming this class by its dotted path and listing the module ids::

    config.training(replay_buffer_config={
        "type": "replay_server.ray.rllib_multi.ShardedMultiAgentEpisodeReplayBuffer",
        "capacity": 50_000, "alpha": 0.6, "beta": 0.4,
        "module_ids": ["p0", "p1"],                 # one table each: rllib-p0, rllib-p1
        "replay": "dqn", "num_shards": 2,
    })

It subclasses RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer`` (so the
algorithm sends it each module's TD errors) and keeps that class's contract
for what DQN uses, its ``"independent"`` replay mode:

* :meth:`add` takes ``MultiAgentEpisode``s (whole or chunks of running ones)
  and stores each agent's steps, as rows (:mod:`~replay_server.ray.rllib_rows`),
  in the table of the module the episode maps that agent to
  (``episode.module_for(agent_id)``, as RLlib's buffer does). Each module's
  table is ``<table_prefix><module id>`` and holds ``capacity`` rows (agent
  steps) over the shards.
* :meth:`sample` draws ``num_items`` rows by priority for each module (or
  each of ``modules_to_sample``) from that module's table, exact over every
  shard, and returns RLlib's list of one-step ``SingleAgentEpisode``s with
  ``agent_id``, ``module_id`` and ``multi_agent_episode_id`` set, one
  module's rows after another's. Within a module, the rows of one agent's
  episode are next to each other (in the order they were first drawn): RLlib's
  learner batches a module's rows grouped by (episode, agent), so its TD
  errors come back in that order, and :meth:`update_priorities` gives the
  k-th TD error to the k-th row returned. (RLlib's own buffer returns them in
  draw order and so can give a TD error to another row of the same batch.)
* :meth:`update_priorities` ``(td_errors, module_id)`` sets the priorities of
  that module's rows of the last sample, in that module's table only.
* ``n_step``/``gamma`` (the tables build n-step returns at sample time),
  ``alpha``/``beta``, ``prefetch`` (a sample stream per module) and
  ``pending_adds`` (background inserts per module), :meth:`flush`,
  :meth:`get_state`/:meth:`set_state`, :meth:`get_metrics` and
  :meth:`close` work as in the single-agent
  :class:`~replay_server.ray.rllib.ShardedEpisodeReplayBuffer`.

Refused by name, nothing stored: an agent mapped to a module not in
``module_ids`` (``ConfigError``), a listed module whose table the replay
lacks or does not prioritize (``ConfigError`` at construction), a single-agent
episode (``TypeError``), ``replay_mode="synchronized"`` (``ValueError``:
RLlib's synchronized mode draws whole environment steps across modules, which
per-module tables do not keep together).

What differs from RLlib's buffer: each module's table overwrites its oldest
rows one by one (RLlib evicts whole episodes); the totals it reports
(``get_num_timesteps()``, ``num_env_steps_stored``) count agent steps, the
rows over every module's table (RLlib's count environment steps).

Thread-safety: as RLlib's buffer, one caller at a time (the algorithm's
training step).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import (
    MultiAgentEpisodeReplayBuffer,
)
from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import (
    MultiAgentPrioritizedEpisodeReplayBuffer,
)

from replay_server.errors import ConfigError
from replay_server.ray.cluster import DEFAULT_NAMESPACE, ReplayCluster
from replay_server.ray.rllib_episodes import EpisodeWindow
from replay_server.ray.rllib_rows import episode_number, episodes_of, rows_of
from replay_server.ray.rllib_written import (
    WriteFailure,
    WrittenAgentEpisode,
    WrittenMultiAgentEpisode,
)
from replay_server.ray.rllib_table import (
    BufferTable,
    check_options,
    check_sample_args,
    open_replay,
    table_entry,
)


class ShardedMultiAgentEpisodeReplayBuffer(MultiAgentPrioritizedEpisodeReplayBuffer):
    """RLlib's multi-agent prioritized episode buffer over a replay's shards, one table per
    module id (see the module docstring).

    Args:
        capacity: rows (agent steps) each module's table keeps, over all the shards.
        module_ids: the modules whose rows are stored (one table each): every agent of
            every episode added must map to one of them.
        table_prefix: a module's table is ``table_prefix + module_id``.
        batch_size_B, batch_length_T, alpha, beta, metrics_num_episodes_for_smoothing,
            replay, num_shards, namespace, n_step, gamma, checkpoint_dir,
            checkpoint_interval_s, shard_options, address, client_options, prefetch,
            pending_adds: as :class:`~replay_server.ray.rllib.ShardedEpisodeReplayBuffer`
            (``prefetch`` and ``pending_adds`` per module).

    Raises:
        ConfigError: a bad option (named), or a listed module whose table the replay (at
            ``address=``) lacks or does not prioritize (named); nothing is stored.
        ReplayExistsError: the replay runs with other tables.
    """

    def __init__(self, capacity: int = 10000, *, module_ids: Sequence[str] | None = None,
                 table_prefix: str = "rllib-", batch_size_B: int = 16, batch_length_T: int = 1,
                 alpha: float = 1.0, beta: float = 0.4,
                 metrics_num_episodes_for_smoothing: int = 100, replay: str = "rllib",
                 num_shards: int = 1, namespace: str = DEFAULT_NAMESPACE, n_step: int = 1,
                 gamma: float = 0.99, checkpoint_dir: str | None = None,
                 checkpoint_interval_s: float = 60.0, shard_options: Any = None,
                 address: str | None = None, client_options: Mapping[str, Any] | None = None,
                 prefetch: int = 2, pending_adds: int = 4, **kwargs: Any) -> None:
        MultiAgentEpisodeReplayBuffer.__init__(  # not the parent's: its trees stay unused
            self, capacity=capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
            metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        check_options(batch_length_T=batch_length_T, n_step=n_step, prefetch=prefetch,
                      pending_adds=pending_adds)
        modules = _module_list(module_ids)
        self._n_step, self._gamma = n_step, float(gamma)
        entries = [table_entry(f"{table_prefix}{m}", capacity=capacity, num_shards=num_shards,
                               alpha=float(alpha), beta=float(beta), n_step=n_step,
                               gamma=self._gamma) for m in modules]
        self._cluster, self._client = open_replay(
            entries, replay=replay, num_shards=num_shards, namespace=namespace,
            checkpoint_dir=checkpoint_dir, checkpoint_interval_s=checkpoint_interval_s,
            shard_options=shard_options, address=address, client_options=client_options)
        self._tables = {m: BufferTable(self._client, f"{table_prefix}{m}", beta=beta,
                                       prefetch=prefetch, pending_adds=pending_adds)
                        for m in modules}
        # For the episodes of the last `capacity` rows of every table: agent episode number
        # -> its keys (ids, agent, module), and the multi-agent episodes by id.
        rows = capacity * len(modules)
        self._agents: EpisodeWindow[int, dict[str, Any]] = EpisodeWindow(rows)
        self._episodes: EpisodeWindow[str, None] = EpisodeWindow(rows)
        self._spaces: dict[str, tuple[Any, Any]] = {}
        self._filled: set[str] = set()  # modules whose table holds rows
        self._estimating = False  # inside add(): get_num_timesteps estimates
        self.rows_sent = 0  # agent steps this buffer's add inserted itself
        self.rows_written_by_env_runners = 0  # agent steps ShardedMultiAgentEnvRunners wrote
        try:
            info = self._client.info()
            for module, table in self._tables.items():
                try:
                    table.check(info)
                except ConfigError as exc:
                    raise ConfigError(f"module {module!r}: {exc}") from exc
                if int(info[table.name].size) > 0:
                    self._filled.add(module)
        except BaseException:
            self.close()
            raise

    @property
    def client(self) -> Any:
        """The ``ReplayClient`` the rows go through."""
        return self._client

    @property
    def cluster(self) -> ReplayCluster | None:
        """The replay made or found at construction (``None`` where ``address=`` named one)."""
        return self._cluster

    def table_of(self, module_id: Any) -> str:
        """The name of ``module_id``'s table.

        Raises:
            ConfigError: ``module_id`` is not one of ``module_ids`` (named).
        """
        return self._table(module_id, "table_of").name

    def _table(self, module_id: Any, doing: str) -> BufferTable:
        if module_id not in self._tables:
            raise ConfigError(f"{doing}: module {module_id!r} is not one of this buffer's "
                              f"module_ids {list(self._tables)} (each has a table of its own)")
        return self._tables[module_id]

    # ------------------------------------------------------------ what RLlib calls

    def add(self, episodes: Any,  # type: ignore[override]  # RLlib's parent's own signature
            weight: float | Mapping[str, float] | None = None) -> None:
        """Store every agent step of ``episodes`` (one ``MultiAgentEpisode`` or a list) as a
        row of its module's table; ``weight``: their priority, one for all or one per
        module id (default: the largest the table has seen, as RLlib's).
        :class:`~replay_server.ray.rllib_written.WrittenMultiAgentEpisode`s (rows a
        ``ShardedMultiAgentEnvRunner`` inserted itself) are counted, not sent.

        Raises:
            TypeError: an episode that is not a ``MultiAgentEpisode``, or an observation
                that is not an array; nothing stored.
            ConfigError: an agent mapped to a module not in ``module_ids``; nothing stored.
            ValueError: a weight that is not finite and >= 0; nothing stored.
            WriterError: an earlier background insert failed, or an env runner's (a
                ``WriteFailure`` among ``episodes``: raised after the rest was added).
        """
        given = list(episodes) if isinstance(episodes, list) else [episodes]
        for episode in given:
            if not isinstance(episode, (MultiAgentEpisode, WrittenMultiAgentEpisode,
                                        WriteFailure)):
                raise TypeError(f"ShardedMultiAgentEpisodeReplayBuffer stores "
                                f"MultiAgentEpisodes, got {type(episode).__name__} (single "
                                f"agent: replay_server.ray.rllib.ShardedEpisodeReplayBuffer)")
        listed = [e for e in given if not isinstance(e, WriteFailure)]
        sent = [e for e in listed if isinstance(e, MultiAgentEpisode)]
        by_module = self._agent_episodes(sent)
        written = self._written_parts([e for e in listed
                                       if isinstance(e, WrittenMultiAgentEpisode)])
        weights = {m: _weight_of(weight, m) for m in by_module}
        rows = {m: rows_of(parts) for m, parts in by_module.items()}  # all checked first
        for module, columns in rows.items():
            self._tables[module].add(columns, len(columns["t"]), weights[module])
            self._filled.add(module)
            self.rows_sent += len(columns["t"])
        for module, parts in written.items():  # stored by the env runners: counted only
            steps = sum(len(p) for p in parts)
            self._tables[module].count_written(steps)
            self._filled.add(module)
            self.rows_written_by_env_runners += steps
            self.metrics.log_value("num_agent_steps_written_by_env_runners", steps,
                                   reduce="sum")
        counted: dict[str, list[Any]] = {m: list(parts) for m, parts in by_module.items()}
        for module, parts in written.items():
            counted.setdefault(module, []).extend(parts)
        if listed:
            self._count_added(listed, counted)
        failed = [e for e in given if isinstance(e, WriteFailure)]
        if failed:  # an env runner's insert failed: raised here, in the driver
            raise failed[0].error()

    def _written_parts(self, episodes: list[WrittenMultiAgentEpisode]
                       ) -> dict[str, list[WrittenAgentEpisode]]:
        """Each module's written agent episodes of ``episodes``, in order.

        Raises:
            ConfigError: a module not in ``module_ids`` (its rows went to a table this
                buffer does not sample).
        """
        by_module: dict[str, list[WrittenAgentEpisode]] = {}
        for episode in episodes:
            for part in episode.agents:
                if part.module_id not in self._tables:
                    raise ConfigError(f"add: an env runner wrote agent {part.agent_id!r} of "
                                      f"episode {episode.id_!r} to module "
                                      f"{part.module_id!r}, not one of module_ids "
                                      f"{list(self._tables)}")
                by_module.setdefault(part.module_id, []).append(part)
        return by_module

    def _agent_episodes(self, episodes: list[Any]) -> dict[str, list[SingleAgentEpisode]]:
        """Each module's agent episodes (those with steps) of ``episodes``, in order."""
        by_module: dict[str, list[SingleAgentEpisode]] = {}
        for episode in episodes:
            for agent_id, agent_episode in episode.agent_episodes.items():
                if len(agent_episode) == 0:
                    continue
                module = episode.module_for(agent_id)
                if module not in self._tables:
                    raise ConfigError(f"add: agent {agent_id!r} of episode {episode.id_!r} "
                                      f"maps to module {module!r}, not one of module_ids "
                                      f"{list(self._tables)}; nothing was stored")
                by_module.setdefault(module, []).append(agent_episode)
        return by_module

    def _count_added(self, episodes: list[Any], by_module: dict[str, list[Any]]) -> None:
        """RLlib's counters and add metrics for what :meth:`add` stored (agent episodes, or
        the parts env runners wrote: both have ``id_``, ``agent_id``, ``len``...)."""
        counts: dict[str, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
        for module, parts in by_module.items():
            if module not in self._spaces:  # from the first part that carries them
                spaced = [p for p in parts if p.observation_space is not None]
                if spaced:
                    self._spaces[module] = (spaced[0].observation_space,
                                            spaced[0].action_space)
            for part in parts:
                counts["agent_steps"][part.agent_id] += len(part)
                counts["module_steps"][module] += len(part)
                keys = {"id_": part.id_, "agent_id": part.agent_id, "module_id": module,
                        "multi_agent_episode_id": part.multi_agent_episode_id}
                # a later chunk continues its episode, as in RLlib
                if self._agents.add(episode_number(part.id_), keys, len(part)):
                    counts["agent_episodes"][part.agent_id] += 1
                    counts["module_episodes"][module] += 1
                    self._num_module_episodes[module] += 1
        new = {e.id_ for e in episodes if self._episodes.add(e.id_, None, e.agent_steps())}
        env_steps = sum(e.env_steps() for e in episodes)
        self._num_timesteps_added += env_steps
        self._num_agent_timesteps_added += sum(counts["agent_steps"].values())
        for module, steps in counts["module_steps"].items():
            self._num_module_timesteps_added[module] += steps
        self._estimating = True  # RLlib's add metrics ask the size: no round trip per add
        try:
            self._update_add_metrics(
                num_episodes_added=len(new), num_env_steps_added=env_steps,
                num_episodes_evicted=0, num_env_steps_evicted=0,  # as RLlib's, none evicted
                agent_to_num_episodes_added=dict(counts["agent_episodes"]),
                agent_to_num_steps_added=dict(counts["agent_steps"]),
                agent_to_num_episodes_evicted={}, agent_to_num_steps_evicted={},
                module_to_num_episodes_added=dict(counts["module_episodes"]),
                module_to_num_steps_added=dict(counts["module_steps"]),
                module_to_num_episodes_evicted={}, module_to_num_steps_evicted={})
        finally:
            self._estimating = False

    def sample(self,  # type: ignore[override]  # RLlib's annotation; its buffer returns this
               num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: Any = None, gamma: Any = None,
               include_infos: bool = False, include_extra_model_outputs: bool = False,
               replay_mode: str = "independent", modules_to_sample: Any = None,
               beta: float | None = None, to_numpy: bool = False,
               **kwargs: Any) -> list[SingleAgentEpisode]:
        """``num_items`` transitions of each module (``modules_to_sample``, default: each
        with rows), drawn by priority from its table over every shard, as RLlib's buffer
        returns them (see the module docstring).

        Raises:
            ValueError: an argument this buffer cannot honour (named, with what to set).
            ConfigError: a module in ``modules_to_sample`` not in ``module_ids``.
        """
        if num_items is not None and batch_size_B is not None:
            raise ValueError("sample(): give num_items or batch_size_B, not both")
        if replay_mode != "independent":
            raise ValueError(f"sample(replay_mode={replay_mode!r}): this buffer samples each "
                             f"module's rows from its own table ('independent', what DQN "
                             f"uses); 'synchronized' needs whole environment steps across "
                             f"modules, which per-module tables do not keep together")
        size = int(num_items or batch_size_B or self.batch_size_B)
        check_sample_args(n_step_stored=self._n_step, gamma_stored=self._gamma,
                          batch_length_T=batch_length_T, n_step=n_step, gamma=gamma,
                          include_infos=include_infos,
                          include_extra_model_outputs=include_extra_model_outputs)
        modules = ([m for m in self._tables if m in self._filled] if modules_to_sample is None
                   else list(dict.fromkeys(modules_to_sample)))
        tables = [self._table(m, "sample") for m in modules]  # all named before any draw
        episodes: list[SingleAgentEpisode] = []
        drawn: dict[str, Any] = {}
        for module, table in zip(modules, tables):
            drawn[module] = table.draw(size, beta)
            episodes += self._module_episodes(module, table, drawn[module])
            self.sampled_timesteps_per_module[module] += size
        if to_numpy:
            for episode in episodes:
                episode.to_numpy()
        self.sampled_timesteps += size
        self._update_sample_metrics(**_sample_metrics(episodes, drawn))
        return episodes

    def _module_episodes(self, module: str, table: BufferTable,
                         batch: Any) -> list[SingleAgentEpisode]:
        """The episodes of ``module``'s batch, grouped by (episode, agent) in the order
        first drawn, the table's last ids in the same order (see the module docstring)."""
        def fields(number: int) -> dict[str, Any]:
            known = self._agents.get(number)
            if known is not None:
                return known
            name = f"{number:016x}"  # rows another writer stored: their own keys
            return {"id_": name, "agent_id": name, "module_id": module,
                    "multi_agent_episode_id": name}

        episodes = episodes_of(batch, fields, self._spaces.get(module, (None, None)))
        first: dict[tuple[Any, Any], int] = {}
        for i, e in enumerate(episodes):
            first.setdefault((e.multi_agent_episode_id, e.agent_id), i)
        order = sorted(range(len(episodes)), key=lambda i: (
            first[(episodes[i].multi_agent_episode_id, episodes[i].agent_id)], i))
        table.last_ids = table.last_ids[torch.tensor(order, dtype=torch.int64)]
        return [episodes[i] for i in order]

    def update_priorities(self, priorities: Any, module_id: Any = None) -> None:
        """Set the priorities of ``module_id``'s rows of the last :meth:`sample`, in the
        order returned (RLlib's TD errors; values below 1e-12 raised to it, as RLlib's).

        Raises:
            ConfigError: ``module_id`` is not one of ``module_ids``; nothing applied.
            ValueError: not one priority per row of that module's last sample, or a value
                that is not finite; nothing applied.
        """
        table = self._table(module_id, "update_priorities")
        values = np.asarray(priorities, dtype=np.float64).reshape(-1)
        stale = table.update(values)
        if stale is not None:
            self.metrics.log_value("num_priorities_stale", stale, reduce="sum")
        if len(values):
            self.metrics.log_value("num_priorities_updated", len(values), reduce="sum")
            self.metrics.log_value(("module_to_num_priorities_updated", module_id),
                                   len(values), reduce="sum")

    def get_num_timesteps(self, module_id: Any = None) -> int:
        """Rows stored now in ``module_id``'s table (default: in every module's), over every
        shard, the adds on their way stored first (within :meth:`add`, for RLlib's add
        metrics, an estimate without a round trip, as the single-agent buffer's).

        Raises:
            ConfigError: ``module_id`` is not one of ``module_ids``.
        """
        tables = ([self._table(module_id, "get_num_timesteps")] if module_id is not None
                  else list(self._tables.values()))
        if self._estimating:  # each table holds at most `capacity` rows
            return sum(min(int(self.capacity), t.size(estimate=True)) for t in tables)
        return sum(t.size() for t in tables)

    def get_num_agent_timesteps(self) -> int:
        """Rows stored now over every module's table (each row an agent step)."""
        return self.get_num_timesteps()

    def get_num_episodes(self, module_id: Any = None) -> int:
        """Agent episodes added of ``module_id`` (default: multi-agent episodes added)."""
        if module_id is not None:
            self._table(module_id, "get_num_episodes")
            return self._num_module_episodes[module_id]
        return self._episodes.added

    def get_num_episodes_evicted(self, module_id: Any = None) -> int:
        """0: the tables overwrite rows, not whole episodes (see the module docstring)."""
        return 0

    def get_module_ids(self) -> list[str]:
        """The module ids this buffer has a table for."""
        return list(self._tables)

    def flush(self) -> None:
        """Store the adds on their way and apply the priority updates still riding on each
        module's sample stream (the next :meth:`sample` opens new streams).

        Raises:
            WriterError: an add on its way failed.
        """
        for table in self._tables.values():
            table.flush()

    def get_state(self) -> dict[str, Any]:
        """A checkpoint of every shard now and this buffer's counters (what RLlib keeps in
        its algorithm checkpoint): ``{"replay", "tables": {module: table},
        "checkpoints": {shard: path}, ...}``."""
        self.flush()  # the updates on their way belong in the checkpoint
        checkpoints = self._client.checkpoint()
        if isinstance(checkpoints, str):
            checkpoints = {0: checkpoints}
        return {"replay": self._client_address(),
                "tables": {m: t.name for m, t in self._tables.items()},
                "checkpoints": dict(checkpoints),
                "max_priority": {m: t.max_priority for m, t in self._tables.items()},
                "num_timesteps_added": self._num_timesteps_added,
                "num_agent_timesteps_added": self._num_agent_timesteps_added,
                "module_timesteps_added": dict(self._num_module_timesteps_added),
                "module_episodes": dict(self._num_module_episodes),
                "sampled_timesteps": self.sampled_timesteps,
                "sampled_timesteps_per_module": dict(self.sampled_timesteps_per_module),
                "agent_episodes": self._agents.state(),
                "episodes": self._episodes.state()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`get_state`'s counters. The rows are the replay's: its shards
        restore them from ``checkpoint_dir`` when they start, not this call.

        Raises:
            ValueError: ``state`` is of another replay or other tables (named).
        """
        tables = {m: t.name for m, t in self._tables.items()}
        if state.get("tables") != tables or state.get("replay") != self._client_address():
            raise ValueError(f"set_state: the state is of tables {state.get('tables')!r} of "
                             f"{state.get('replay')!r}, this buffer's are {tables!r} of "
                             f"{self._client_address()!r}")
        for module, table in self._tables.items():
            table.max_priority = float(state["max_priority"][module])
        self._num_timesteps_added = int(state["num_timesteps_added"])
        self._num_agent_timesteps_added = int(state["num_agent_timesteps_added"])
        self._num_module_timesteps_added = defaultdict(int, state["module_timesteps_added"])
        self._num_module_episodes = defaultdict(int, state["module_episodes"])
        self.sampled_timesteps = int(state["sampled_timesteps"])
        self.sampled_timesteps_per_module = defaultdict(
            int, state["sampled_timesteps_per_module"])
        if "episodes" in state:
            for window, key in ((self._agents, "agent_episodes"),
                                (self._episodes, "episodes")):
                window.restore(state[key]["episodes"], state[key]["added"])
        else:  # a state saved before the windows (every episode, no row counts)
            agents = [dict(a) for a in state.get("agent_episodes", [])]
            self._agents.restore([(episode_number(a["id_"]), a, 1) for a in agents],
                                 len(agents))
            ids = list(state.get("episode_ids", []))
            self._episodes.restore([(i, None, 1) for i in ids], len(ids))

    def _client_address(self) -> str:
        return self._cluster.address if self._cluster is not None else str(
            getattr(self._client, "address", ""))

    def close(self) -> None:
        """Close every module's sample stream (its updates applied) and the client (the
        replay keeps running: ``buffer.cluster.shutdown()`` stops it)."""
        try:
            for table in getattr(self, "_tables", {}).values():
                table.close()
        finally:
            self._client.close()


def _module_list(module_ids: Any) -> list[str]:
    """``module_ids`` checked: a non-empty list of distinct strings.

    Raises:
        ConfigError: naming what is wrong.
    """
    if (isinstance(module_ids, str) or not isinstance(module_ids, Sequence)
            or not module_ids):
        raise ConfigError(f"module_ids must list the module ids whose rows are stored (one "
                          f"table each, e.g. ['p0', 'p1']), got {module_ids!r}")
    for module in module_ids:
        if not isinstance(module, str) or not module:
            raise ConfigError(f"module_ids: each must be a non-empty string, got {module!r}")
    if len(set(module_ids)) != len(module_ids):
        raise ConfigError(f"module_ids lists a module twice: {list(module_ids)}")
    return list(module_ids)


def _weight_of(weight: Any, module: str) -> float | None:
    """``module``'s priority for new rows from :meth:`add`'s ``weight``.

    Raises:
        ValueError: a weight that is not finite and >= 0 (named).
    """
    value = weight.get(module) if isinstance(weight, Mapping) else weight
    if value is None:
        return None
    if not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"add: weight {value!r} for module {module!r} must be finite and "
                         f">= 0; nothing was stored")
    return float(value)


def _sample_metrics(episodes: list[SingleAgentEpisode],
                    drawn: Mapping[str, Any]) -> dict[str, Any]:
    """RLlib's sample metrics of a multi-agent sample: ``episodes`` as returned, ``drawn``
    each module's batch. A step counts once per row id (an agent step: RLlib counts
    environment steps where it is not per agent)."""
    steps: dict[str, dict[Any, int]] = {"agent": defaultdict(int), "module": defaultdict(int)}
    parts: dict[str, dict[Any, set]] = {"agent": defaultdict(set), "module": defaultdict(set)}
    rows: dict[str, dict[Any, set]] = {"agent": defaultdict(set), "module": defaultdict(set)}
    n: dict[str, dict[Any, list]] = {"agent": defaultdict(list), "module": defaultdict(list)}
    for e in episodes:
        step_n = int(e.extra_model_outputs["n_step"][0])
        for level, key in (("agent", e.agent_id), ("module", e.module_id)):
            steps[level][key] += 1
            parts[level][key].add(e.id_)
            rows[level][key].add((e.id_, e.t_started))
            n[level][key].append(step_n)
    every_n = [x for values in n["module"].values() for x in values]
    unique = sum(len(set(batch.ids.tolist())) for batch in drawn.values())
    metrics: dict[str, Any] = {
        "num_env_steps_sampled": len(episodes),
        "num_episodes_per_sample": len({e.multi_agent_episode_id for e in episodes}),
        "num_env_steps_per_sample": unique,
        "sampled_n_step": float(np.mean(every_n)) if every_n else 0.0, "num_resamples": 0}
    for level in ("agent", "module"):
        metrics[f"{level}_to_num_steps_sampled"] = dict(steps[level])
        metrics[f"{level}_to_num_episodes_per_sample"] = {k: len(v) for k, v in
                                                          parts[level].items()}
        metrics[f"{level}_to_num_steps_per_sample"] = {k: len(v) for k, v in
                                                       rows[level].items()}
        metrics[f"{level}_to_sampled_n_step"] = {k: float(np.mean(v)) for k, v in
                                                 n[level].items()}
        metrics[f"{level}_to_num_resamples"] = dict.fromkeys(steps[level], 0)
    return metrics
