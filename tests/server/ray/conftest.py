"""A real two-node Ray cluster on loopback for the ``replay_server.ray`` tests.

Ray 2.60 turns a node address of 127.0.0.1 into the host's interface address
unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before Ray is imported
(Ray reads it into ``ray_constants.ENABLE_RAY_CLUSTER`` at import): set here,
and checked before anything starts, so no test listens on or sends to any
address but 127.0.0.1. The nodes are told apart by custom resources
(``node_a`` on the head, ``node_b`` on the second), one CPU each.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

SKIP_REASON = "Ray is not importable: pip install 'replay-server[ray]'"
"""Each test module skips with this where Ray is missing (``pytest.importorskip`` there: a
conftest may not skip)."""

NODE_A = {"node_a": 0.001}  # a shard or task on the head node
NODE_B = {"node_b": 0.001}  # ... on the second node


def loopback_addresses() -> set[str]:
    """Every Ray node's address, and the GCS's host."""
    import ray

    found = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    found.add(ray.get_runtime_context().gcs_address.rsplit(":", 1)[0])
    return found


def add_node_b(cluster):
    return cluster.add_node(num_cpus=1, resources={"node_b": 1}, wait=True)


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator:
    """Two nodes of one CPU each (``node_a``, ``node_b``), this process connected as a driver.

    One for the package: the modules that run one after another in a process share it
    (a start is 10-30 s on a loaded 2-core machine), and it stops before any test outside
    this package runs (``tests/test_docs.py`` starts Ray its own way). Each test leaves
    it as it found it: its replays shut down, a removed node added back."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    if ray_constants.ENABLE_RAY_CLUSTER:
        pytest.fail("Ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set: its "
                    "nodes would bind the host's address, not 127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False})
    try:
        add_node_b(cluster)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        assert loopback_addresses() == {"127.0.0.1"}, loopback_addresses()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
