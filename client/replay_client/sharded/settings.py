"""A sharded client's own settings, checked before any connection is made.

Thread-safety: pure functions.
"""

from __future__ import annotations

from typing import Any

from replay_client.errors import InvalidArgumentError
from replay_client.sharded.deadline import check_deadline


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
            isinstance(resolve_interval_s, (int, float)) and not isinstance(
                resolve_interval_s, bool) and resolve_interval_s > 0):
        raise InvalidArgumentError(f"resolve_interval_s must be a number of seconds > 0 "
                                   f"or None, got {resolve_interval_s!r}")
    if isinstance(wait_for_shards_s, bool) or not isinstance(
            wait_for_shards_s, (int, float)) or not wait_for_shards_s >= 0:
        raise InvalidArgumentError(f"wait_for_shards_s must be a number of seconds >= 0, "
                                   f"got {wait_for_shards_s!r}")
    try:
        check_deadline(shard_deadline_s)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
