"""The registry actor's process loads Ray and the registry, not torch, gRPC or the client.

Ray starts the registry actor (and restarts it, after a crash or a lost node)
in a fresh worker that unpickles ``ShardRegistry`` by reference: it imports
``replay_server.ray.registry``, and so the ``replay_server.ray`` package. That
package's names load on first use; before, each registry process imported
torch, gRPC and the client with it (about 3 s of CPU on a 2-core machine, and
a registry Ray restarts is that much later). Checked by what a fresh
interpreter has imported, never by timing it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.ray.conftest import SKIP_REASON

pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)

HEAVY = ("torch", "grpc", "replay_client", "replay_server.engine", "replay_server.app",
         "replay_server.ray.cluster", "replay_server.ray.shard")


def test_the_registry_module_loads_nothing_heavy() -> None:
    probe = (f"import json, sys; import replay_server.ray.registry as r; r.ShardRegistry; "
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_every_exported_name_resolves() -> None:
    import replay_server.ray as front
    from replay_server.ray.cluster import ReplayCluster

    assert sorted(front.__all__) == ["ReplayCluster", "ReplayExistsError",
                                     "ReplayNotFoundError", "ScaleDownError"]
    assert all(getattr(front, name) is not None for name in front.__all__)
    assert front.ReplayCluster is ReplayCluster
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        front.no_such_name  # noqa: B018
