"""``ShardedEnvRunner``: RLlib env runners that write their samples to the replay's shards.

RLlib 2.60's DQN (and every off-policy algorithm built on its training
step) gathers the env runners' episodes into the algorithm's process and
adds them to the buffer there: every row crosses env runner -> driver ->
shard. With :class:`ShardedEnvRunner` named as the env runners' class, each
env runner inserts the rows of what it sampled into the replay's shards
itself, through a client of its own, and hands the driver
:class:`WrittenEpisode`s: an episode's id and step counts, no rows. The
buffer (:class:`~replay_server.ray.rllib.ShardedEpisodeReplayBuffer`)
counts them as added and sends nothing::

    config.env_runners(num_env_runners=2, env_runner_cls=ShardedEnvRunner)
    config.training(replay_buffer_config={
        "type": "replay_server.ray.rllib.ShardedEpisodeReplayBuffer", ...})

The env runner reads where to write from ``replay_buffer_config`` (``replay``
and ``namespace``, or ``address``; ``table``; ``client_options``;
``pending_adds``), so the config names the replay once.

**Writes overlap the driver's training step.** A sample's rows go to the
shards from a background thread of the env runner (``pending_adds``
inserts on their way at most, as in the buffer's own adds; 0: the sample
waits for its insert), while the driver trains. So a batch the driver
samples may not include the rows of the env runners' last sample yet, as
with the buffer's own background adds; :meth:`ShardedEnvRunner.flush` (on
every env runner: :func:`flush_env_runners`) stores them.

**A failed write is raised by the driver's next add**, as ``WriterError``
naming the env runner, the rows and the cause (a refusing shard names
itself, its table and the key): the env runner's next sample steps no
environment and returns a :class:`WriteFailure` carrying the error, which
the buffer's ``add`` raises in the algorithm's process (after counting what
else it was given), so ``train()`` raises it. (An exception raised inside an
env runner's ``sample`` would not reach the driver: RLlib 2.60 ends the env
runner's process on any error there and reports only ``ActorDiedError``.)
The inserts queued after a failed one are not sent, and every later sample
and :func:`flush_env_runners` report the same error: no row is silently
dropped, and none is stored out of order.

Evaluation env runners (``config.in_evaluation``) write nothing and return
their episodes as RLlib's do. Single-agent only: a multi-agent config (its
env runner is :class:`~replay_server.ray.rllib_multi_env_runner.ShardedMultiAgentEnvRunner`),
or a buffer that is not a ``ShardedEpisodeReplayBuffer`` (it could not store
:class:`WrittenEpisode`s), is refused by name when the env runner is made.

Cost on an env runner: one pass over the sampled steps to build the rows
(:func:`~replay_server.ray.rllib_rows.rows_of`) and one insert per sample;
on the driver: a few integers per episode chunk.
Thread-safety: as RLlib's env runners, one caller at a time.
"""

from __future__ import annotations

from typing import Any

from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

import replay_client
from replay_server.errors import ConfigError
from replay_server.ray.rllib import ShardedEpisodeReplayBuffer
from replay_server.ray.rllib_rows import rows_of
from replay_server.ray.rllib_shard_writer import ShardWriter, configured_class
from replay_server.ray.rllib_written import WriteFailure, WrittenEpisode

__all__ = ["ShardedEnvRunner", "WriteFailure", "WrittenEpisode", "flush_env_runners"]

WriterError = replay_client.errors.WriterError  # through the client's front door


class ShardedEnvRunner(SingleAgentEnvRunner):
    """RLlib's single-agent env runner, its samples written to the replay's shards (see the
    module docstring).

    Raises:
        ConfigError: the buffer is not a ``ShardedEpisodeReplayBuffer``, or the config is
            multi-agent (named).
    """

    def __init__(self, *, config: Any, **kwargs: Any) -> None:
        settings = dict(config.replay_buffer_config or {})
        _check_buffer(settings.get("type"), multi_agent=config.is_multi_agent)  # before the env
        super().__init__(config=config, **kwargs)
        self._table = str(settings.get("table", "rllib"))
        self._writer = ShardWriter(settings, f"env runner {self.worker_index}'s sample")
        self._spaces_sent = False

    def sample(self, **kwargs: Any) -> list[Any]:
        """RLlib's sample; where this env runner trains, its steps are inserted into the
        replay's table and :class:`WrittenEpisode`s are returned in the episodes' place.
        Once an insert failed: ``[WriteFailure]``, nothing sampled (see the module
        docstring)."""
        if self.config.in_evaluation:
            return super().sample(**kwargs)
        failure = self._writer.failure()
        if failure is not None:
            return [failure]
        episodes = super().sample(**kwargs)
        listed = [e for e in episodes if len(e) > 0]
        if listed:
            try:
                self._writer.put(self._table, rows_of(listed), sum(len(e) for e in listed))
            except WriterError as exc:  # an earlier insert failed meanwhile
                return [WriteFailure(str(exc))]
        return [self._written(e) for e in listed]

    def _written(self, episode: Any) -> WrittenEpisode:
        spaces = None
        if not self._spaces_sent:
            spaces = (episode.observation_space, episode.action_space)
            self._spaces_sent = True
        return WrittenEpisode(id_=episode.id_, steps=len(episode),
                              agent_steps=episode.agent_steps(), spaces=spaces)

    def flush(self) -> WriteFailure | None:
        """Wait until this env runner's inserts are stored; returns the one that failed, as
        a :class:`WriteFailure` (raised by :func:`flush_env_runners` in the driver), or
        ``None``."""
        return self._writer.failure(wait=True)

    def stop(self) -> None:
        """Store the inserts on their way (up to 30 s; a failure is logged, naming the rows),
        end the writer thread and close the client, then RLlib's stop."""
        try:
            self._writer.close()
        finally:
            super().stop()


def flush_env_runners(algo: Any) -> None:
    """Wait until every remote env runner of ``algo`` (and its local one) has stored its
    inserts (an env runner that is not a :class:`ShardedEnvRunner` or a
    ``ShardedMultiAgentEnvRunner`` is passed over).

    Raises:
        WriterError: an env runner's insert failed.
    """
    results = algo.env_runner_group.foreach_env_runner(  # single- and multi-agent ones
        lambda runner: runner.flush() if isinstance(getattr(runner, "_writer", None),
                                                    ShardWriter) else None,
        local_env_runner=True)
    for result in results:
        if isinstance(result, WriteFailure):
            raise result.error()


def _check_buffer(kind: Any, *, multi_agent: bool) -> None:
    """Refuse configs whose buffer could not store :class:`WrittenEpisode`s (named)."""
    resolved = configured_class(kind)
    if multi_agent or not (resolved is not None
                           and issubclass(resolved, ShardedEpisodeReplayBuffer)):
        raise ConfigError(
            f"ShardedEnvRunner writes its samples to the replay's shards and hands the "
            f"driver no rows: replay_buffer_config['type'] must be "
            f"'replay_server.ray.rllib.ShardedEpisodeReplayBuffer' (got {kind!r})"
            + ("; a multi-agent config takes replay_server.ray.rllib_multi_env_runner."
               "ShardedMultiAgentEnvRunner" if multi_agent else ""))
