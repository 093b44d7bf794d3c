"""Where a server's tables get their shard and id incarnations (ids: :mod:`.id_space`).

A server with a ``checkpoint_dir`` takes its incarnations from a durable
counter there (:mod:`replay_server.checkpoint.incarnation`); a server without
one starts at a random incarnation (:class:`RandomIncarnations`); in-process
tables count from 0 (:class:`LocalIncarnations`). Separate from the id
arithmetic so that checking a config (the shard index) loads neither numpy
nor the tables. Not thread-safe: a source is asked at start and under a
table's lock.
"""

from __future__ import annotations

import secrets
from typing import Any, Protocol

from replay_proto.id_layout import MAX_INCARNATION, MAX_SHARD
from replay_proto.scalars import is_int
from replay_server.errors import ConfigError


class IncarnationSource(Protocol):
    """Where a server's tables get their shard and incarnations.

    ``current`` is the incarnation new segments start with; :meth:`advance`
    gives out a new one (durably, where the source is persistent) when a
    table has used ``current`` already or rolls over a full segment.
    """

    shard: int

    @property
    def current(self) -> int: ...

    def advance(self, floor: int) -> int:
        """A new incarnation above ``floor`` and every one given out before; it becomes current.

        Raises:
            ConfigError: all 65,535 incarnations are used up.
        """
        ...


class LocalIncarnations:
    """Incarnations of in-process tables: start at ``incarnation`` (0), count up in memory.

    Args:
        shard: the shard index ids carry.
        incarnation: the first incarnation.
    """

    def __init__(self, shard: int = 0, incarnation: int = 0) -> None:
        check_shard(shard)
        self.shard = shard
        self._current = incarnation

    @property
    def current(self) -> int:
        return self._current

    def advance(self, floor: int) -> int:
        new = max(self._current, floor) + 1
        if new > MAX_INCARNATION:
            raise ConfigError(exhausted_message())
        self._current = new
        return new


class RandomIncarnations(LocalIncarnations):
    """A non-persistent server's incarnations: a random start in [1, 65535], then counting up."""

    def __init__(self, shard: int = 0) -> None:
        super().__init__(shard, 1 + secrets.randbelow(MAX_INCARNATION))


def check_shard(shard: Any) -> int:
    if not is_int(shard) or not 0 <= shard <= MAX_SHARD:
        raise ConfigError(f"server.shard must be an integer in [0, {MAX_SHARD}], got {shard!r}")
    return shard


def exhausted_message() -> str:
    return (f"all {MAX_INCARNATION:,} id incarnations are used up (one per server start and "
            f"per 2**40 rows of a table); start with a new checkpoint_dir")
