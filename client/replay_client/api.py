"""``ReplayApi``: the calls every replay client offers, whether it talks to one server or many.

Two implementations satisfy it: :class:`~replay_client.server_client.ServerClient`
(one server) and :class:`~replay_client.sharded.client.ShardedClient` (one
logical replay over many servers, a layer over one-server clients). Code that
only needs a replay (a learner, an actor, ``RemoteReplayBuffer``) takes a
``ReplayApi``; :class:`~replay_client.client.ReplayClient`, the front door,
builds the right one from the address. The one-server client never imports
the sharded one (``tests/test_layout.py``).

What each call does is documented once, on the one-server client; the sharded
client's docstrings say what differs over shards (``docs/scale-out.md``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from replay_client.table_info import TableInfo
from replay_client.variables import Variable
from replay_client.vector_writer import END_KEYS, VectorWriter
from replay_client.writer import Writer
from replay_feed.options import StreamOptions
from replay_feed.stream import BatchStream
from replay_proto.batch import SampleBatch


@runtime_checkable
class ReplayApi(Protocol):
    """A replay client: one server's, or a sharded one's (see the module docstring)."""

    @property
    def address(self) -> Any:
        """Where the replay is: ``host:port``, a list of them, or a ``shards://`` name."""

    @property
    def timeout(self) -> float | None:
        """Seconds each call may take, retries included (``None``: no limit)."""

    def insert(self, table: str, data: Any, priorities: Any = None) -> torch.Tensor:
        """Append rows to ``table``; their int64 ids, in row order."""

    def sample(self, table: str, batch_size: int, *, wait: bool = False,
               timeout: Any = ...) -> SampleBatch:
        """One batch, drawn as one table holding every row would draw it."""

    def stream(self, table: str, batch_size: int, options: StreamOptions | None = None,
               **keywords: Any) -> BatchStream:
        """A learner's stream of batches (``StreamOptions`` names the keywords)."""

    def update_priorities(self, table: str, ids: Any, priorities: Any, *,
                          wait: bool = True) -> int | None:
        """Set priorities by id; how many ids named stored rows (``None`` with ``wait=False``)."""

    def flush_updates(self, timeout: float | None = None) -> None:
        """Wait until every ``wait=False`` update was applied (or raise its error)."""

    def delete(self, table: str, ids: Any) -> int:
        """Remove rows by id from a queue table; how many were present."""

    def read(self, table: str, **request: Any) -> Any:
        """Stored rows by ``positions=`` or ``ids=`` (one server; a sharded client refuses)."""

    def write(self, table: str, positions: Any, data: Any) -> int:
        """Overwrite stored rows by position (one server; a sharded client refuses)."""

    def set_sampling(self, table: str, **settings: Any) -> tuple[float, float]:
        """Set ``alpha=``, ``beta=``, ``seed=`` of ``table`` from the next draw on."""

    def info(self) -> dict[str, TableInfo]:
        """Every table's sizes, counters, settings and capabilities, by name."""

    def checkpoint(self, *, timeout: float | None = 600.0) -> str | dict[int, str]:
        """Have the server(s) write a checkpoint; where it was written."""

    def reset(self, table: str, *, schema: bool = False) -> None:
        """Remove every row of ``table`` (``schema=True``: and forget its schema)."""

    def ack(self, table: str) -> None:
        """Acknowledge the rows this client's samples of queue table ``table`` took."""

    def publish(self, name: str, state_dict: Any) -> int:
        """Store ``state_dict`` as the next version of variable ``name``; that version."""

    def fetch(self, name: str, newer_than: int | None = None,
              timeout: float | None = None) -> Variable | None:
        """The newest version of variable ``name`` (or the first newer than ``newer_than``)."""

    def writer(self, table: str, **options: Any) -> Writer:
        """An actor's per-step writer to ``table``."""

    def vector_writer(self, table: str, num_envs: int | None = None, *, env: Any = None,
                      autoreset_mode: Any = None, end_keys: tuple[str, ...] = END_KEYS,
                      next_obs_key: str = "next_obs", **options: Any) -> VectorWriter:
        """An actor's writer of a vector env's steps to ``table``, one episode per sub-env."""

    def close(self) -> None:
        """Send pending updates and close the connection(s); a later call reconnects."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...
