"""What a ``ShardedEnvRunner`` hands the driver in place of the episodes it wrote.

:class:`WrittenEpisode`: an episode chunk whose rows the env runner inserted
into the replay's shards itself (its id and step counts, no rows), which
``ShardedEpisodeReplayBuffer.add`` counts and does not send.
:class:`WriteFailure`: an insert of the env runner failed, which that
``add`` raises as ``WriterError`` in the algorithm's process.

Both are small frozen values (a few integers and a string; the spaces once
per env runner) that Ray pickles from env runner to driver.
Thread-safety: immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import replay_client

__all__ = ["WriteFailure", "WrittenEpisode"]


@dataclass(frozen=True)
class WrittenEpisode:
    """An episode chunk an env runner wrote to the shards itself: what the driver's buffer
    counts, without its rows.

    Attributes:
        id_: RLlib's episode id (chunks of one episode share it).
        steps: its env steps (rows written).
        agent_steps: its agent steps.
        spaces: ``(observation_space, action_space)`` on an env runner's first chunk (the
            buffer builds the episodes it samples with them), else ``None``.
    """

    id_: str
    steps: int
    agent_steps: int
    spaces: tuple[Any, Any] | None = None

    def __len__(self) -> int:
        return self.steps

    def env_steps(self) -> int:
        """Its env steps, as an episode's ``env_steps()``."""
        return self.steps


@dataclass(frozen=True)
class WriteFailure:
    """What an env runner hands the driver in place of a sample once one of its inserts
    failed: the buffer's ``add`` raises :attr:`message` as ``WriterError``.

    Attributes:
        message: the ``WriterError``'s message (the env runner, the rows, the cause).
    """

    message: str

    def __len__(self) -> int:
        return 0

    def error(self) -> Exception:
        """The ``WriterError`` to raise in the driver."""
        return replay_client.errors.WriterError(self.message)
