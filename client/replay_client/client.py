"""``ReplayClient``: the front door, building the client an address names.

``ReplayClient("host:port")`` is a :class:`~replay_client.server_client.ServerClient`
(one server); ``ReplayClient(["host-0:50051", "host-1:50051"])`` and
``ReplayClient("shards://name:port")`` are a
:class:`~replay_client.sharded.client.ShardedClient` (one logical replay over
many servers, a layer over one-server clients). Both implement
:class:`~replay_client.api.ReplayApi`, and ``isinstance(c, ReplayClient)``
holds for both. This module is the only one of the plain client's that knows
the sharded one exists (``tests/test_layout.py``).
"""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, Any

from replay_client.api import ReplayApi
from replay_client.errors import InvalidArgumentError
from replay_client.server_client import ServerClient
from replay_client.sharded.client import ShardedClient
from replay_client.sharded.discovery import is_sharded


if TYPE_CHECKING:  # a type checker would take a subclass of the protocol for an abstract
    _Front = ABC     # class that cannot be made; it reads ReplayClient(...) as a ReplayApi
else:                # from __new__. At run time the class keeps the protocol's calls
    _Front = ReplayApi  # (help(ReplayClient.sample), inspect.signature(ReplayClient.reset)).


class ReplayClient(_Front):
    """A replay client for ``address`` (see the module docstring); returns the one it builds.

    Args:
        address: ``host:port`` of one server; a list of ``host:port`` (one per
            shard) or ``"shards://NAME:PORT"`` for a sharded replay.
        **options: the chosen client's keywords: ``timeout``, ``token``,
            ``max_message_mb``, ``max_retry_s``, ``tls``,
            ``allow_plaintext_token``, ``connect_timeout_s`` for every client (see
            :class:`~replay_client.server_client.ServerClient`); ``resolver``,
            ``seed``, ``allow_degraded``, ``resolve_interval_s``,
            ``wait_for_shards_s``, ``shard_deadline_s`` for a sharded one (see
            :class:`~replay_client.sharded.client.ShardedClient`).

    Raises:
        InvalidArgumentError: an address of the wrong type, or a sharded
            keyword given for one server.
    """

    def __new__(cls, address: Any = "localhost:50051",  # type: ignore[misc]
                **options: Any) -> ReplayApi:
        if is_sharded(address):
            return ShardedClient(address, **options)
        if not isinstance(address, str):
            raise InvalidArgumentError(
                f"address must be 'host:port', a list of shard addresses or "
                f"'shards://name:port', got {type(address).__name__}")
        sharded_only = sorted(set(options) & _SHARDED_ONLY)
        if sharded_only:
            raise InvalidArgumentError(
                f"{', '.join(sharded_only)} apply to a sharded client (a list of addresses or "
                f"a 'shards://' name), not to one server at {address!r}")
        return ServerClient(address, **options)


_SHARDED_ONLY = frozenset({"resolver", "seed", "allow_degraded", "resolve_interval_s", "client",
                           "wait_for_shards_s", "shard_deadline_s"})

ReplayClient.register(ServerClient)
ReplayClient.register(ShardedClient)
