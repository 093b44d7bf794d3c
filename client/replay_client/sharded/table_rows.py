"""Rows by position and sampling settings on a sharded client (``read``, ``write``, ``set_sampling``).

``set_sampling`` (alpha, beta, seed) goes to every shard: the logical table
draws with the same settings on each. Storage positions are per shard (each
server has its own ring), so ``read`` and ``write`` by position have no
meaning for the logical table and are refused, naming the way: one shard's
own ``ReplayClient``. :class:`ShardedTableRows` gives
:class:`~replay_client.sharded.client.ShardedClient` these calls as its own.

Thread-safety: as the sharded client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replay_client.errors import UnsupportedError


def _refusal(what: str, table: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} rows of table {table!r} by storage position is per shard (each server "
        f"has its own positions): use that shard's ReplayClient(address) "
        f"(client.shards maps shard index -> address)")


class ShardedTableRows:
    """``set_sampling``, ``read`` and ``write`` of the sharded client (a base class of
    :class:`~replay_client.sharded.client.ShardedClient`; see the module docstring).
    ``_all`` is the client's: one call on every shard, answers by shard index."""

    def _all(self, call: Callable[[Any], Any]) -> dict[int, Any]:
        raise NotImplementedError  # the sharded client's

    def set_sampling(self, table: str, **settings: Any) -> tuple[float, float]:
        """Set how ``table`` draws on every shard (see ``ReplayClient.set_sampling``)."""
        answers = self._all(lambda client: client.set_sampling(table, **settings))
        return next(iter(answers.values()))

    def read(self, table: str, **request: Any) -> Any:
        """Refused: reading rows by position is per shard (see the module docstring)."""
        raise _refusal("reading", table)

    def write(self, table: str, positions: Any, data: Any) -> int:
        """Refused: writing rows by position is per shard (see the module docstring)."""
        raise _refusal("writing", table)
