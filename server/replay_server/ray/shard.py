"""``ReplayShard``: one shard of a replay on Ray, a replay server inside its actor's own process.

The actor runs an :class:`~replay_server.app.embedded.EmbeddedServer` in its
process (never a child process: Ray kills a worker's children with it, and
an in-process server's tables, threads and final checkpoint live and die with
the actor). On start, and on every restart Ray makes (``max_restarts``), it

1. tells the registry it is ``starting`` (and gets its incarnation),
2. restores its newest checkpoint from ``<checkpoint_dir>/<replay>/shard-<i>``
   (storage every node can read, so a shard restarted on another node finds it),
3. binds its address (the node's IP, port 0, unless ``server.address``
   says otherwise) and ``/metrics`` (port 0),
4. reports ``serving`` with the address clients should use: the node's IP
   as Ray knows it (a shard bound to ``0.0.0.0`` is reached at its node's IP).

A graceful stop (:meth:`drain`) reports ``draining``, stops the server (new
calls refused, in-flight ones finished within ``grace``, then the final
checkpoint) and reports ``gone``. A shard a scale down removes
(:meth:`hand_over`) drains the same way, then inserts its rows into the
shards that stay (:mod:`~replay_server.ray.handover`) and sets its
checkpoint folder aside (``shard-<i>.retired-<time>``), so a shard of that
index started later begins empty instead of restoring rows that now live
elsewhere. A hand-over that fails part-way, or a scale down that fails on
another shard (:meth:`resume`), ends with the shard serving again (a new
server, a new incarnation in the registry) holding only the rows that did
not move, checkpointed. A crash loses the rows inserted since the
shard's last checkpoint (``checkpoint_interval_s``).

Thread-safety: a threaded actor (``max_concurrency`` > 1): :meth:`describe`
answers while a drain runs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from replay_client import ReplayClient
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer
from replay_server.engine import TableConfig
from replay_server.errors import ConfigError
from replay_server.ray.handover import (
    HandOverError,
    hand_over,
    keep_unmoved,
    retire_folder,
    unretire_folder,
)
from replay_server.ray.registry import ask
from replay_server.service.settings import ServerSettings


def shard_settings(index: int, *, bind_host: str, server: Mapping[str, Any],
                   tables: Sequence[Any], checkpoint_dir: str | None, replay: str
                   ) -> ServerSettings:
    """Shard ``index``'s server settings: ``server`` (the ``[server]`` keys) over the
    shard's defaults, and ``tables`` (``[[tables]]`` dicts or ``TableConfig`` objects).

    Raises:
        ConfigError: a bad key or value (named), or tables of both kinds.
    """
    options = {"address": f"{bind_host}:0", "metrics_address": f"{bind_host}:0",
               **server, "shard": index}
    if checkpoint_dir is not None:
        options["checkpoint_dir"] = str(Path(checkpoint_dir) / replay / f"shard-{index}")
    configs = [t for t in tables if isinstance(t, TableConfig)]
    if configs and len(configs) != len(tables):
        raise ConfigError("tables must be all dicts (as replay.toml's [[tables]] parse to) or "
                          "all TableConfig objects, not a mix")
    if configs:
        return dataclasses.replace(settings_from_dict({"server": options}),
                                   tables=tuple(configs))
    return settings_from_dict({"server": options, "tables": [dict(t) for t in tables]})


class ReplayShard:
    """One shard (see the module docstring). Run as a named, detached Ray actor.

    Args:
        replay: the replay's name (its registry actor's name).
        namespace: the Ray namespace of the replay's actors.
        index: this shard's index (the ``shard`` its server reports).
        server: ``[server]`` keys for its server (``shard`` is set here).
        tables: the tables, as :func:`shard_settings` takes them.
        checkpoint_dir: the replay's checkpoint root (``None``: no persistence).
    """

    def __init__(self, replay: str, namespace: str, index: int, server: Mapping[str, Any],
                 tables: Sequence[Any], checkpoint_dir: str | None) -> None:
        self._index = index
        self._registry = ray.get_actor(replay, namespace=namespace)
        self._incarnation = ask(self._registry, "starting", index)
        self._host = ray.util.get_node_ip_address()
        settings = shard_settings(index, bind_host=self._host, server=server, tables=tables,
                                  checkpoint_dir=checkpoint_dir, replay=replay)
        self._server = EmbeddedServer(settings)  # restores its newest checkpoint first
        bound = self._server.address
        assert bound is not None
        self._address = f"{self._host}:{bound.rsplit(':', 1)[1]}"
        self._state = "serving"
        self._handed: dict[str, Any] | None = None  # what a finished hand-over answered
        self._moved: dict[str, Any] = {}  # the positions it moved, by table
        ask(self._registry, "serving", **self._said())

    def _said(self) -> dict[str, Any]:
        metrics = self._server.metrics_address
        if metrics is not None:
            metrics = f"{self._host}:{metrics.rsplit(':', 1)[1]}"
        return {"index": self._index, "incarnation": self._incarnation,
                "address": self._address, "metrics_address": metrics, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def describe(self) -> dict[str, Any]:
        """This shard now: state, address, metrics address, incarnation, pid, node id."""
        return {**self._said(), "state": self._state}

    def drain(self, grace: float = 10.0) -> None:
        """Stop gracefully: refuse new calls, finish in-flight ones within ``grace`` seconds,
        write the final checkpoint. Idempotent."""
        if self._state != "serving":
            return
        self._stop(grace)
        self._state = "gone"
        ask(self._registry, "gone", self._index)

    def _stop(self, grace: float) -> None:
        self._state = "draining"
        ask(self._registry, "draining", self._index)
        self._server.close(grace)

    def hand_over(self, addresses: list[str], grace: float = 10.0) -> dict[str, Any]:
        """Leave the replay (a scale down): drain (final checkpoint), insert every row into
        the shards at ``addresses`` (those that stay, in index order), then set the checkpoint
        folder aside. Asked again after it handed over (a scale retried): the same answer.

        If an insert fails part-way (:class:`~replay_server.ray.handover.HandOverError`),
        this shard serves again at once (a new server, checkpointed), holding only the rows
        that did not move: every row stays stored once, and a scale asked again moves the
        rest.

        Returns:
            ``{"moved": {table: rows}, "retired_checkpoints": path or None}``, or after a
            failure ``{"moved": ..., "left": {table: rows}, "failure": message}``.

        Raises:
            Exception: serving again failed (named by the caller: the final checkpoint holds
                every row, the moved ones too).
        """
        if self._handed is not None:
            return self._handed
        if self._state == "serving":
            self._stop(grace)
        clients = [ReplayClient(address) for address in addresses]
        try:
            moved = hand_over(self._server.tables, clients)
        except HandOverError as exc:
            left = self._serve_again(exc.moved)
            return {"moved": {n: int(p.size) for n, p in exc.moved.items()}, "left": left,
                    "failure": str(exc)}
        finally:
            for client in clients:
                client.close()
        self._moved = {table.config.name: table.live_positions()
                       for table in self._server.tables}
        folder = self._server.settings.checkpoint_dir
        retired = None
        if folder is not None and os.path.isdir(folder):
            retired = retire_folder(folder)
        self._handed = {"moved": moved, "retired_checkpoints": retired}
        return self._handed

    def resume(self) -> dict[str, int]:
        """Serve again after a hand-over that moved every row, when the scale down failed on
        another shard (the replay still expects this one): empty, its checkpoint folder back
        in place. Idempotent: the rows each table holds."""
        if self._handed is None:
            return {table.config.name: table.size for table in self._server.tables}
        retired = self._handed["retired_checkpoints"]
        folder = self._server.settings.checkpoint_dir
        if retired is not None and folder is not None:
            unretire_folder(retired, folder)
        self._handed = None
        return self._serve_again(self._moved)

    def _serve_again(self, moved: Mapping[str, Any]) -> dict[str, int]:
        """Serve again (a new server: restored from the final checkpoint, or empty) holding
        the rows not in ``moved`` (:func:`~replay_server.ray.handover.keep_unmoved`), then
        checkpoint that (a restart brings back no moved row) and report ``serving``."""
        old = self._server
        self._incarnation = ask(self._registry, "starting", self._index)
        self._state = "starting"
        self._server = EmbeddedServer(old.settings)
        left = keep_unmoved(old.tables, self._server.tables, moved)
        bound = self._server.address
        assert bound is not None
        self._address = f"{self._host}:{bound.rsplit(':', 1)[1]}"
        if old.settings.checkpoint_dir is not None:
            with ReplayClient(self._address) as client:
                client.checkpoint()
        self._state = "serving"
        ask(self._registry, "serving", **self._said())
        return left
