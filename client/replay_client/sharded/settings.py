"""A sharded client's own settings: what it is made from, checked before any connection is
made, and what a pickled client carries (it is made again from them in the other process).

Thread-safety: a frozen value and pure functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replay_client.errors import InvalidArgumentError
from replay_client.sharded.deadline import check_deadline
from replay_proto.scalars import is_real


def checked_settings(*, allow_degraded: Any, resolve_interval_s: Any, wait_for_shards_s: Any,
                     shard_deadline_s: Any) -> None:
    """Refuse a bad ``allow_degraded``, ``resolve_interval_s``, ``wait_for_shards_s`` or
    ``shard_deadline_s`` (see :class:`~replay_client.sharded.client.ShardedClient`).

    Raises:
        InvalidArgumentError: naming the setting and the value given.
    """
    if not isinstance(allow_degraded, bool):
        raise InvalidArgumentError(f"allow_degraded must be True or False, got {allow_degraded!r}")
    if resolve_interval_s is not None and not (
            is_real(resolve_interval_s) and resolve_interval_s > 0):
        raise InvalidArgumentError(f"resolve_interval_s must be a number of seconds > 0 "
                                   f"or None, got {resolve_interval_s!r}")
    if not is_real(wait_for_shards_s) or not wait_for_shards_s >= 0:
        raise InvalidArgumentError(f"wait_for_shards_s must be a number of seconds >= 0, "
                                   f"got {wait_for_shards_s!r}")
    try:
        check_deadline(shard_deadline_s)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


DEGRADED_RETRY_S = 0.5
"""A shard client's retry window in degraded mode, unless ``max_retry_s`` is given."""


@dataclass(frozen=True)
class ShardedSettings:
    """Everything a :class:`~replay_client.sharded.client.ShardedClient` is made from (its
    arguments: see there), validated at construction.

    Raises:
        InvalidArgumentError: a bad ``allow_degraded``, ``resolve_interval_s``,
            ``wait_for_shards_s`` or ``shard_deadline_s``, named with the value given.
    """

    address: Any
    client: Callable[..., Any]
    resolver: Any
    seed: int | None
    allow_degraded: bool
    resolve_interval_s: float | None
    wait_for_shards_s: float
    shard_deadline_s: float
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checked_settings(allow_degraded=self.allow_degraded,
                         resolve_interval_s=self.resolve_interval_s,
                         wait_for_shards_s=self.wait_for_shards_s,
                         shard_deadline_s=self.shard_deadline_s)

    @property
    def shard_options(self) -> dict[str, Any]:
        """What each shard's one-server client is made with: the options given, and in
        degraded mode a short retry window (:data:`DEGRADED_RETRY_S`) unless given."""
        if self.allow_degraded:
            return {"max_retry_s": DEGRADED_RETRY_S, **self.options}
        return self.options
