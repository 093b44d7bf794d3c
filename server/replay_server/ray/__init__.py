"""replay_server.ray: a sharded replay as Ray actors (``pip install 'replay-server[ray]'``).

:class:`~replay_server.ray.cluster.ReplayCluster` starts one in one call, finds
it from any driver, task or actor, checkpoints and stops it
(``docs/ray.md``). Shards are :class:`~replay_server.ray.shard.ReplayShard`
actors, each a replay server in its actor's process; the
:class:`~replay_server.ray.registry.ShardRegistry` actor lists them with their
states for clients (``ray://<namespace>/<name>``).

The package sits above ``replay_server.app`` (it runs embedded servers) and is
the one place the server side uses the client package (``ReplayCluster.client``):
nothing else imports it (``tests/test_layout.py``).

The names below load on first use (:mod:`replay_proto.exports`): a Ray worker
that unpickles the registry actor imports ``replay_server.ray.registry``, and
with it this package, and needs Ray alone, not torch, gRPC and the client that
``ReplayCluster`` brings (about 3 s of CPU more in each registry process, paid
again at every restart Ray makes).
"""

from __future__ import annotations

# ruff: noqa: F401 - the imports under TYPE_CHECKING are this package's exports

from typing import TYPE_CHECKING

from replay_proto.exports import lazy_exports

if TYPE_CHECKING:
    from replay_server.ray.cluster import (
        ReplayCluster,
        ReplayExistsError,
        ReplayNotFoundError,
        ScaleDownError,
    )
else:
    __getattr__, __dir__ = lazy_exports(__name__)
