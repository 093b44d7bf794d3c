"""What a ``ShardedEnvRunner`` hands the driver in place of the episodes it wrote.

:class:`WrittenEpisode`: an episode chunk whose rows the env runner inserted
into the replay's shards itself (its id and step counts, no rows), which
``ShardedEpisodeReplayBuffer.add`` counts and does not send.
:class:`WrittenMultiAgentEpisode`: the same for a multi-agent episode chunk
(``ShardedMultiAgentEnvRunner``), one :class:`WrittenAgentEpisode` per agent
that stepped, for ``ShardedMultiAgentEpisodeReplayBuffer.add``.
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

__all__ = ["WriteFailure", "WrittenAgentEpisode", "WrittenEpisode", "WrittenMultiAgentEpisode"]


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
class WrittenAgentEpisode:
    """One agent's part of a :class:`WrittenMultiAgentEpisode`: what the multi-agent buffer
    keeps of an agent episode (the attributes of RLlib's ``SingleAgentEpisode`` it reads).

    Attributes:
        id_: the agent episode's id (chunks of one share it).
        agent_id, module_id, multi_agent_episode_id: whose steps, in which module's table.
        steps: its steps (rows written to the module's table).
        observation_space, action_space: on an env runner's first chunk of the module,
            else ``None``.
    """

    id_: str
    agent_id: Any
    module_id: str
    multi_agent_episode_id: str
    steps: int
    observation_space: Any = None
    action_space: Any = None

    def __len__(self) -> int:
        return self.steps


@dataclass(frozen=True)
class WrittenMultiAgentEpisode:
    """A multi-agent episode chunk an env runner wrote to the shards itself (its agents'
    rows in their modules' tables): what the driver's multi-agent buffer counts.

    Attributes:
        id_: RLlib's multi-agent episode id.
        steps: its env steps.
        agents: one part per agent that stepped.
    """

    id_: str
    steps: int
    agents: tuple[WrittenAgentEpisode, ...]

    def __len__(self) -> int:
        return self.steps

    def env_steps(self) -> int:
        """Its env steps, as a ``MultiAgentEpisode``'s ``env_steps()``."""
        return self.steps

    def agent_steps(self) -> int:
        """Its agents' steps together, as a ``MultiAgentEpisode``'s ``agent_steps()``."""
        return sum(a.steps for a in self.agents)


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
