"""``ShardedDQNTorchLearner``: DQN learners that draw their share of each train batch from the shards.

RLlib 2.60's DQN samples the train batch in the algorithm's process and the
learner group ships it to the learners: every sampled row crosses shard ->
driver -> learner. With ``"learners_draw": True`` in ``replay_buffer_config``
the buffer's sample returns draw orders instead
(:mod:`~replay_server.ray.rllib_draws`), the learner group splits them among
its learners as it would split the episodes, and each learner of this class
draws its share from the shards itself (a sample stream of its own, by
priority over every shard), trains on it, and sends the TD errors back to the
shards as the rows' priorities. The driver then handles no row at all, with
``ShardedEnvRunner``\\ s writing (:mod:`~replay_server.ray.rllib_env_runner`)::

    config.env_runners(env_runner_cls=ShardedEnvRunner)
    config.learners(learner_class=ShardedDQNTorchLearner)
    config.training(replay_buffer_config={
        "type": "replay_server.ray.rllib.ShardedEpisodeReplayBuffer",
        "learners_draw": True, ...})

Each learner's share is drawn by priority over the whole replay, as the
driver's one batch was; two learners' shares are two independent draws (a
row can be in both, as it can be twice in one batch). A learner's TD errors
go back on its own stream's credits (as the buffer's updates do), so the
priorities a later draw sees may lag one step, as with the buffer's
``prefetch``. The learner's sample metrics stay on the learner; the driver's
buffer logs how many rows it ordered (``num_rows_ordered_from_learners``).

A learner given real episodes (another buffer, or ``learners_draw`` off)
trains on them as DQN's own learner does.

Cost on a learner: one stream and one client per replay; its draws overlap
its training (``prefetch``). Thread-safety: as RLlib's learners.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.utils.metrics import TD_ERROR_KEY
from ray.rllib.utils.numpy import convert_to_numpy

from replay_server.ray.rllib import ShardedEpisodeReplayBuffer
from replay_server.ray.rllib_draws import DrawSpec, draw_order

__all__ = ["ShardedDQNTorchLearner"]


class ShardedDQNTorchLearner(DQNTorchLearner):
    """RLlib's DQN torch learner, drawing its share of each batch from the shards (see the
    module docstring)."""

    def update(self, batch: Any = None,  # type: ignore[override]  # RLlib calls by keyword
               *, training_data: Any = None, episodes: Any = None, **kwargs: Any) -> Any:
        """Train on ``episodes`` (or ``training_data``), as DQN's learner does; given draw
        orders, draw that many rows from the shards first and send their TD errors back.

        Raises:
            ValueError: draw orders mixed with episodes, or of several draws.
        """
        given = training_data.episodes if training_data is not None else episodes
        order = draw_order(given)
        if order is None:
            return super().update(batch, training_data=training_data, episodes=episodes,
                                  **kwargs)
        spec, rows = order
        reader = self._reader(spec)
        drawn = reader.sample(num_items=rows, beta=spec.beta)
        results = super().update(episodes=list(drawn), **kwargs)
        errors = _td_errors(results) if results is not None else np.empty(0)
        if len(errors):
            reader.update_priorities(errors)
        return results

    def _reader(self, spec: DrawSpec) -> ShardedEpisodeReplayBuffer:
        """This learner's buffer over the replay of ``spec`` (made on first use): it only
        samples and updates priorities."""
        readers: dict[tuple[str, str], ShardedEpisodeReplayBuffer] = \
            self.__dict__.setdefault("_replay_readers", {})
        key = (spec.address, spec.table)
        reader = readers.get(key)
        if reader is None:
            reader = readers[key] = ShardedEpisodeReplayBuffer(
                capacity=spec.capacity, alpha=spec.alpha, beta=spec.beta, n_step=spec.n_step,
                gamma=spec.gamma, table=spec.table, address=spec.address,
                client_options=dict(spec.client_options), prefetch=spec.prefetch,
                pending_adds=0)
        reader.set_spaces(spec.spaces)
        return reader

    def shutdown(self) -> None:
        """Close the learner's readers (their updates on their way applied), then RLlib's."""
        for reader in self.__dict__.pop("_replay_readers", {}).values():
            reader.close()
        super().shutdown()


def _td_errors(results: dict[str, Any]) -> np.ndarray:
    """The TD errors of the update's rows, in the order they were drawn, taken out of
    ``results`` (DQN's driver would otherwise send them to its buffer too)."""
    errors = []
    for module_results in results.values():
        if isinstance(module_results, dict) and TD_ERROR_KEY in module_results:
            stats = module_results.pop(TD_ERROR_KEY)
            value = stats.peek() if hasattr(stats, "peek") else stats
            errors += [np.asarray(v, dtype=np.float64).reshape(-1)
                       for v in convert_to_numpy(value if isinstance(value, list) else [value])]
    return np.concatenate(errors) if errors else np.empty(0)
