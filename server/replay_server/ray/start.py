"""``python -m replay_server.ray.start``: start (or find) a replay on the Ray cluster this runs on.

What a KubeRay ``RayJob`` (``deploy/kuberay``) runs as its entrypoint: it
connects to the cluster (``ray.init(address="auto")``), calls
:meth:`ReplayCluster.create` with ``get_if_exists=True`` (a job run again, or
retried after a failure, gets the running replay, its missing shards
started) and prints every shard's state. The replay's actors are detached:
they outlive the job.

The tables come from a ``replay.toml`` (its ``[[tables]]``; ``[server]``
keys other than the addresses and ``checkpoint_dir``, which the replay sets
per shard, go to every shard)::

    python -m replay_server.ray.start replay --config /config/replay.toml \\
        --num-shards 4 --checkpoint-dir /checkpoints --shard-resources '{"replay": 1}'
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from replay_server.errors import ConfigError

SET_PER_SHARD = ("address", "metrics_address", "checkpoint_dir", "shard")
"""``[server]`` keys the replay sets for each shard itself (ignored in the file)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m replay_server.ray.start",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the replay's name (clients: ray://<namespace>/<name>)")
    parser.add_argument("--config", required=True, help="a replay.toml: its [[tables]]")
    parser.add_argument("--num-shards", type=int, required=True)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="storage every replay pod mounts (a ReadWriteMany volume)")
    parser.add_argument("--checkpoint-interval-s", type=float, default=300.0)
    parser.add_argument("--shard-resources", default="{}",
                        help="JSON: Ray custom resources each shard needs (selects its nodes)")
    parser.add_argument("--shard-num-cpus", type=float, default=1.0)
    parser.add_argument("--namespace", default="replay")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    return parser


def create_options(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """The replay's name and :meth:`ReplayCluster.create`'s keywords for ``argv``.

    Raises:
        ConfigError: an unreadable config or a bad argument (named).
    """
    args = _parser().parse_args(argv)
    try:
        config = tomllib.loads(Path(args.config).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {args.config}: {exc}") from exc
    try:
        resources = json.loads(args.shard_resources)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--shard-resources is not JSON: {exc}") from exc
    if not isinstance(resources, dict):
        raise ConfigError(f"--shard-resources must be a JSON object, got {resources!r}")
    server = {k: v for k, v in config.get("server", {}).items() if k not in SET_PER_SHARD}
    server.pop("checkpoint_interval_s", None)
    return args.name, {
        "tables": config.get("tables", []), "num_shards": args.num_shards,
        "shard_options": {"num_cpus": args.shard_num_cpus, "resources": resources},
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_interval_s": args.checkpoint_interval_s, "server": server,
        "namespace": args.namespace, "get_if_exists": True, "timeout_s": args.timeout_s}


def main(argv: list[str] | None = None) -> int:
    """Start (or find) the replay; print its shards. Exit status 0 once every shard serves."""
    import ray

    from replay_server.ray.cluster import ReplayCluster

    name, options = create_options(sys.argv[1:] if argv is None else argv)
    ray.init(address="auto")
    replay = ReplayCluster.create(name, **options)
    for shard in replay.states():
        print(f"shard {shard['index']}: {shard['state']} at {shard['address']} "
              f"(incarnation {shard['incarnation']})")
    print(f"clients: ReplayClient({replay.address!r}) or ReplayCluster.get({name!r}, "
          f"namespace={replay.namespace!r}).client()")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
