"""``ShardedMultiAgentEnvRunner``: RLlib multi-agent env runners that write each module's rows to its table.

The multi-agent form of :mod:`~replay_server.ray.rllib_env_runner`: with
``ShardedMultiAgentEpisodeReplayBuffer`` as the buffer
(:mod:`~replay_server.ray.rllib_multi`, one table per module id) and this
class as the env runners', each env runner inserts every agent's steps of
what it sampled into its module's table (``table_prefix + module_id``) on the
replay's shards itself, through a client of its own, and hands the driver
:class:`~replay_server.ray.rllib_written.WrittenMultiAgentEpisode`\\ s (ids
and step counts per agent, no rows); the buffer counts them and sends
nothing::

    config.env_runners(num_env_runners=2, env_runner_cls=ShardedMultiAgentEnvRunner)
    config.training(replay_buffer_config={
        "type": "replay_server.ray.rllib_multi.ShardedMultiAgentEpisodeReplayBuffer",
        "module_ids": ["p0", "p1"], ...})

As the single-agent env runner: the writes go from background threads
(``pending_adds`` per table), overlapping the driver's training step
(:func:`~replay_server.ray.rllib_env_runner.flush_env_runners` stores them);
a failed insert, or an agent mapped to a module not in ``module_ids``
(nothing of that sample is stored), comes back as a
:class:`~replay_server.ray.rllib_written.WriteFailure` that the buffer's
``add`` raises in the driver as ``WriterError``, and every later sample says
so. Evaluation env runners write nothing. A buffer that is not the sharded
multi-agent one, or a single-agent config, is refused by name when the env
runner is made.

Cost on an env runner: one pass over the sampled agent steps to build each
module's rows and one insert per module per sample; on the driver: a few
integers per agent episode chunk. Thread-safety: as RLlib's env runners.
"""

from __future__ import annotations

from typing import Any

from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner

import replay_client
from replay_server.errors import ConfigError
from replay_server.ray.rllib_multi import ShardedMultiAgentEpisodeReplayBuffer
from replay_server.ray.rllib_rows import rows_of
from replay_server.ray.rllib_shard_writer import ShardWriter, configured_class
from replay_server.ray.rllib_written import (
    WriteFailure,
    WrittenAgentEpisode,
    WrittenMultiAgentEpisode,
)

__all__ = ["ShardedMultiAgentEnvRunner", "written_of"]

WriterError = replay_client.errors.WriterError  # through the client's front door


class ShardedMultiAgentEnvRunner(MultiAgentEnvRunner):
    """RLlib's multi-agent env runner, each module's rows written to its table on the
    replay's shards (see the module docstring).

    Raises:
        ConfigError: the buffer is not a ``ShardedMultiAgentEpisodeReplayBuffer``, it has
            no ``module_ids``, or the config is single-agent (named).
    """

    def __init__(self, *, config: Any, **kwargs: Any) -> None:
        settings = dict(config.replay_buffer_config or {})
        kind = settings.get("type")
        buffer = configured_class(kind)
        if not config.is_multi_agent or buffer is None or not issubclass(
                buffer, ShardedMultiAgentEpisodeReplayBuffer) or not settings.get("module_ids"):
            raise ConfigError(
                f"ShardedMultiAgentEnvRunner writes each module's rows to its table on the "
                f"replay's shards: it needs a multi-agent config and replay_buffer_config "
                f"'type' 'replay_server.ray.rllib_multi.ShardedMultiAgentEpisodeReplayBuffer' "
                f"with its 'module_ids' (got type {kind!r}, module_ids "
                f"{settings.get('module_ids')!r}"
                + ("" if config.is_multi_agent else ", a single-agent config") + ")")
        super().__init__(config=config, **kwargs)
        self._modules = [str(m) for m in settings["module_ids"]]
        self._prefix = str(settings.get("table_prefix", "rllib-"))
        self._writer = ShardWriter(settings, f"env runner {self.worker_index}'s sample")
        self._spaces_sent: set[str] = set()
        self._failed: WriteFailure | None = None

    def sample(self, **kwargs: Any) -> list[Any]:
        """RLlib's sample; where this env runner trains, each module's agent steps are
        inserted into its table and :class:`WrittenMultiAgentEpisode`\\ s are returned in
        the episodes' place. Once an insert failed: ``[WriteFailure]``, nothing sampled."""
        if self.config.in_evaluation:
            return super().sample(**kwargs)
        failure = self._failed or self._writer.failure()
        if failure is not None:
            return [failure]
        episodes = super().sample(**kwargs)
        try:
            written, by_module = written_of(episodes, self._modules, self._spaces_sent)
        except ConfigError as exc:
            self._failed = WriteFailure(f"env runner {self.worker_index}'s sample: {exc}; "
                                        f"nothing of that sample was stored")
            return [self._failed]
        rows = {m: rows_of(parts) for m, parts in by_module.items()}  # all built first
        try:
            for module, columns in rows.items():
                self._writer.put(self._prefix + module, columns, len(columns["t"]))
        except WriterError as exc:  # an earlier insert failed meanwhile
            return [WriteFailure(str(exc))]
        return written

    def flush(self) -> WriteFailure | None:
        """Wait until this env runner's inserts are stored; returns the one that failed (as
        :func:`~replay_server.ray.rllib_env_runner.flush_env_runners` raises it), or
        ``None``."""
        return self._failed or self._writer.failure(wait=True)

    def stop(self) -> None:
        """Store the inserts on their way (up to 30 s each; a failure is logged), end the
        writer threads and close the client, then RLlib's stop."""
        try:
            self._writer.close()
        finally:
            super().stop()


def written_of(episodes: list[Any], modules: list[str], spaces_sent: set[str]
               ) -> tuple[list[WrittenMultiAgentEpisode], dict[str, list[Any]]]:
    """What an env runner hands the driver for ``episodes`` (``MultiAgentEpisode``s),
    and each module's agent episodes (those with steps) whose rows it writes. The spaces
    go with a module's first part (``spaces_sent`` records the modules sent).

    Raises:
        ConfigError: an agent mapped to a module not in ``modules``.
    """
    by_module: dict[str, list[Any]] = {}
    written = []
    for episode in episodes:
        agents = []
        for agent_id, part in episode.agent_episodes.items():
            if len(part) == 0:
                continue
            module = episode.module_for(agent_id)
            if module not in modules:
                raise ConfigError(f"agent {agent_id!r} of episode {episode.id_!r} maps to "
                                  f"module {module!r}, not one of module_ids {modules}")
            by_module.setdefault(module, []).append(part)
            spaces: dict[str, Any] = {}
            if module not in spaces_sent:
                spaces = {"observation_space": part.observation_space,
                          "action_space": part.action_space}
                spaces_sent.add(module)
            agents.append(WrittenAgentEpisode(
                id_=part.id_, agent_id=agent_id, module_id=module,
                multi_agent_episode_id=part.multi_agent_episode_id, steps=len(part),
                **spaces))
        written.append(WrittenMultiAgentEpisode(id_=episode.id_, steps=len(episode),
                                                agents=tuple(agents)))
    return written, by_module
