"""The ``ray://NAMESPACE/NAME`` resolver: a replay's shards as its Ray registry actor lists them.

A replay started with ``replay_server.ray.ReplayCluster`` has one named actor,
its registry, holding every expected shard: index, address, state
(``starting``, ``serving``, ``restarting``, ``draining``, ``gone``) and
incarnation. This resolver asks it for that list (plain data: no server type
crosses), so a client knows how many shards the replay has and which are
down, even when it first connects during a restart.

Ray is imported when a ``ray://`` name is first resolved, never at import:
the client package works without Ray installed. It needs a connected Ray
worker (``ray.init()`` in a driver; inside a Ray task or actor it is).

Cost: one actor call (a few milliseconds) per resolution; the client
resolves when it connects, every ``resolve_interval_s`` and (at most once a
second) while a shard is down.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from replay_client.errors import UnavailableError
from replay_client.sharded.resolution import STATES, Resolution, ShardState

ASK_TIMEOUT_S = 10.0
"""How long one question to the registry may take (asked again while it restarts)."""


def registry_resolver(namespace: str, name: str) -> Resolution:
    """The shards of replay ``name`` in Ray namespace ``namespace``, with their states.

    Raises:
        UnavailableError: Ray is not installed or not connected, there is no such
            replay, or its registry did not answer within :data:`ASK_TIMEOUT_S`.
    """
    try:
        import ray
    except ImportError:
        raise UnavailableError(f"ray://{namespace}/{name} needs Ray: pip install "
                               f"'replay-server[ray]'") from None
    if not ray.is_initialized():
        raise UnavailableError(f"ray://{namespace}/{name}: this process is not connected to "
                               f"Ray (call ray.init() first)")
    try:
        registry = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise UnavailableError(f"no replay {name!r} in Ray namespace {namespace!r} (its "
                               f"registry actor is not there: not started, or shut down)"
                               ) from None
    deadline = time.monotonic() + ASK_TIMEOUT_S
    while True:  # asked again while Ray restarts the registry (its node lost)
        try:
            listed: Any = ray.get(registry.snapshot.remote(),
                             timeout=max(0.1, deadline - time.monotonic()))
            return resolution_of(listed)
        except ray.exceptions.ActorUnavailableError as exc:
            if time.monotonic() >= deadline:
                failure: Exception = exc
                break
            time.sleep(0.2)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            failure = exc
            break
    raise UnavailableError(f"the registry of ray://{namespace}/{name} did not answer: "
                           f"{type(failure).__name__}: {failure}")


def resolution_of(listed: Mapping[str, Any]) -> Resolution:
    """A registry's snapshot (``{"expected": n, "shards": [{index, state, address,
    incarnation}, ...]}``) as a :class:`Resolution`: only ``serving`` shards are connected to."""
    shards = tuple(ShardState(int(s["index"]), str(s["state"]), s.get("address"),
                              int(s.get("incarnation", 0))) for s in listed["shards"])
    for shard in shards:
        if shard.state not in STATES:
            raise UnavailableError(f"the registry lists shard {shard.index} in state "
                                   f"{shard.state!r}, none of {STATES}")
    addresses = tuple(s.address for s in shards if s.state == "serving" and s.address)
    return Resolution(addresses, int(listed["expected"]), shards)
