"""Rows by position and sampling settings on a sharded client (``read``, ``write``, ``set_sampling``).

``set_sampling`` (alpha, beta, seed) goes to every shard: the logical table
draws with the same settings on each. Storage positions are per shard (each
server has its own ring), so ``read`` and ``write`` by position have no
meaning for the logical table and are refused, naming the way: one shard's
own ``ReplayClient``. :func:`with_table_rows` gives
:class:`~replay_client.sharded.client.ShardedClient` these calls as its own.

Thread-safety: as the sharded client.
"""

from __future__ import annotations

from typing import Any

from replay_client.errors import UnsupportedError


def _set_sampling(self: Any, table: str, **settings: Any) -> tuple[float, float]:
    """Set how ``table`` draws on every shard (see ``ReplayClient.set_sampling``)."""
    answers = self._all(lambda client: client.set_sampling(table, **settings))
    return next(iter(answers.values()))


def _refusal(what: str, table: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what} rows of table {table!r} by storage position is per shard (each server "
        f"has its own positions): use that shard's ReplayClient(address) "
        f"(client.shards maps shard index -> address)")


def _read(self: Any, table: str, **request: Any) -> Any:
    """Refused: reading rows by position is per shard (see the module docstring)."""
    raise _refusal("reading", table)


def _write(self: Any, table: str, positions: Any, data: Any) -> int:
    """Refused: writing rows by position is per shard (see the module docstring)."""
    raise _refusal("writing", table)


def with_table_rows(cls: type) -> type:
    """Class decorator: ``cls`` (the sharded client) gets ``set_sampling``, ``read`` and ``write``."""
    cls.set_sampling = _set_sampling
    cls.read = _read
    cls.write = _write
    return cls
