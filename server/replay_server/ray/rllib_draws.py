"""What travels from the algorithm to its learners in place of sampled rows: draw orders.

With ``learners_draw`` (:class:`~replay_server.ray.rllib.ShardedEpisodeReplayBuffer`),
the buffer's ``sample(num_items=n)`` in the algorithm's process draws no row:
it returns ``n`` :class:`DrawRow`\\ s, which RLlib's learner group splits among
its learners as it splits episodes (one env step each), and each learner
(:class:`~replay_server.ray.rllib_learner.ShardedDQNTorchLearner`) draws as
many rows from the replay's shards itself, trains on them and sends their TD
errors back to the shards as priorities. The rows never pass through the
algorithm's process. Every row of one order shares one :class:`DrawSpec`
(pickled once with them): where the replay is and how to draw.

A ``DrawRow`` that reaches a learner of another class fails there naming the
setting (it is no episode: any attribute but ``len`` is refused).

Cost: a few bytes per row sent to a learner. Thread-safety: immutable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DrawSpec:
    """Where a learner draws its share from, and how (one per :meth:`sample` call).

    Attributes:
        address: the replay (``ray://namespace/name`` or shard addresses).
        table: its table.
        capacity, alpha, n_step, gamma: the buffer's (the learner's reader checks them).
        beta: the importance-weight exponent of this draw.
        client_options: the buffer's ``client_options``.
        prefetch: batches the learner's sample stream draws ahead.
        spaces: the episodes' observation and action spaces (``None`` before the first add).
    """

    address: str
    table: str
    capacity: int
    alpha: float
    beta: float
    n_step: int
    gamma: float
    client_options: Mapping[str, Any] = field(default_factory=dict)
    prefetch: int = 2
    spaces: tuple[Any, Any] = (None, None)


class NotAnEpisodeError(AttributeError):
    """A draw order was used as an episode: its learner does not draw from the shards."""


class DrawRow:
    """One row for a learner to draw (see the module docstring); ``len`` 1, as an env step."""

    __slots__ = ("spec",)

    def __init__(self, spec: DrawSpec) -> None:
        self.spec = spec

    def __len__(self) -> int:
        return 1

    def __getstate__(self) -> DrawSpec:
        return self.spec

    def __setstate__(self, spec: DrawSpec) -> None:
        self.spec = spec

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotAnEpisodeError(
            f"a DrawRow (replay_buffer_config 'learners_draw': True) reached a learner that "
            f"treats it as an episode (asked for {name!r}): with learners_draw, set "
            f"config.learners(learner_class=replay_server.ray.rllib_learner."
            f"ShardedDQNTorchLearner), whose learners draw the rows from the shards")


def draw_rows(count: int, spec: DrawSpec) -> list[DrawRow]:
    """``count`` draw orders sharing ``spec``."""
    return [DrawRow(spec) for _ in range(count)]


def draw_order(episodes: Sequence[Any] | None) -> tuple[DrawSpec, int] | None:
    """``(spec, rows)`` if ``episodes`` are draw orders (all of one spec), else ``None``.

    Raises:
        ValueError: draw orders mixed with episodes, or of several specs.
    """
    if not episodes or not any(isinstance(e, DrawRow) for e in episodes):
        return None
    first = next(e for e in episodes if isinstance(e, DrawRow)).spec
    if not all(isinstance(e, DrawRow) and (e.spec is first or e.spec == first)
               for e in episodes):
        raise ValueError("a learner's episodes mix draw orders with episodes, or orders of "
                         "several draws: one sample's orders only")
    return first, len(episodes)
