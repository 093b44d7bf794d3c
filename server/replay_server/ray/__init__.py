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
"""

from replay_server.ray.cluster import (
    ReplayCluster,
    ReplayExistsError,
    ReplayNotFoundError,
    ScaleDownError,
)

__all__ = ["ReplayCluster", "ReplayExistsError", "ReplayNotFoundError", "ScaleDownError"]
