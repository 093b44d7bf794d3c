"""``ShardRegistry``: one replay's every expected shard, its address, state and incarnation.

One named Ray actor per replay (named as the replay, in its namespace)
holds an entry per shard index ``0..num_shards-1``:

* ``state``: ``starting`` (its actor is restoring or not placed yet),
  ``serving``, ``restarting`` (its actor died and Ray restarts it),
  ``draining`` (a graceful stop: final checkpoint), ``gone`` (stopped, or
  dead past its ``max_restarts``);
* ``address``: where clients connect (the node's IP and the bound port),
  ``metrics_address`` (``/metrics``, port 0 bound at start);
* ``incarnation``: how many times the shard has started (1 the first time).

Shards report to it (:meth:`starting` when their actor starts, :meth:`serving`
once restored, :meth:`draining` and :meth:`gone` on a graceful stop). A crash
cannot report itself, so the registry also watches: every
:data:`WATCH_S` seconds it asks each shard to describe itself; an actor that
Ray reports unavailable is ``restarting``, one Ray reports dead is ``gone``,
and one that answers is taken at its word (so a restarted registry, whose
entries start empty, learns the shards back).

Clients read :meth:`snapshot` (plain data: ``replay_client.sharded.ray_registry``
turns it into a resolution; no server type crosses to the client).

Thread-safety: a threaded actor (calls run concurrently); every entry is read
and written under one lock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray

WATCH_S = 0.5
"""How often the registry asks every shard how it is."""

ASK_S = 5.0
"""How long one shard may take to describe itself before the watcher moves on."""


def ask(actor: Any, method: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
    """``actor.<method>(...)``'s result, asked again while Ray restarts ``actor`` (its
    registry or a shard on a lost node), at most ``timeout_s``.

    Raises:
        ray.exceptions.ActorUnavailableError: still restarting after ``timeout_s``.
        ray.exceptions.RayError: the actor is dead, or the call failed.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while True:
        try:
            return ray.get(getattr(actor, method).remote(*args, **kwargs))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)


def shard_actor_name(replay: str, index: int) -> str:
    """The Ray actor name of shard ``index`` of replay ``replay`` (in the replay's namespace)."""
    return f"{replay}.shard-{index}"


class ShardRegistry:
    """One replay's shards (see the module docstring). Run as a named, detached Ray actor.

    Args:
        replay: the replay's name (also this actor's).
        namespace: the Ray namespace of the replay's actors.
        spec: how the replay was created (``num_shards`` and the rest), for
            :meth:`spec` (``ReplayCluster.get``).
    """

    def __init__(self, replay: str, namespace: str, spec: dict[str, Any]) -> None:
        self._replay = replay
        self._namespace = namespace
        self._spec = dict(spec)
        self._lock = threading.Lock()
        self._entries = {i: {"index": i, "state": "starting", "address": None,
                             "metrics_address": None, "incarnation": 0, "pid": None,
                             "node_id": None}
                         for i in range(int(spec["num_shards"]))}
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="replay-registry-watch",
                                         daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------ reads

    def snapshot(self) -> dict[str, Any]:
        """``{"expected": n, "shards": [entry, ...]}`` in index order (plain data)."""
        with self._lock:
            return {"expected": len(self._entries),
                    "shards": [dict(self._entries[i]) for i in sorted(self._entries)]}

    def spec(self) -> dict[str, Any]:
        """How the replay was created (``num_shards``, ``namespace``, options)."""
        return dict(self._spec)

    def describe(self) -> dict[str, Any]:
        """Where the registry runs: its process id and Ray node id."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    # ------------------------------------------------------------ reports

    def starting(self, index: int) -> int:
        """Shard ``index``'s actor started (restoring): its new incarnation."""
        with self._lock:
            entry = self._entry(index)
            entry.update(state="starting", address=None, metrics_address=None,
                         incarnation=entry["incarnation"] + 1)
            return entry["incarnation"]

    def serving(self, index: int, incarnation: int, address: str,
                metrics_address: str | None, pid: int, node_id: str) -> None:
        """Shard ``index`` (its ``incarnation``) serves at ``address``."""
        with self._lock:
            entry = self._entry(index)
            if incarnation < entry["incarnation"]:
                return  # a late report of an earlier life
            entry.update(state="serving", address=address, metrics_address=metrics_address,
                         incarnation=incarnation, pid=pid, node_id=node_id)

    def draining(self, index: int) -> None:
        """Shard ``index`` stops gracefully: new clients leave it out while it checkpoints."""
        self._set_state(index, "draining")

    def gone(self, index: int) -> None:
        """Shard ``index`` has stopped (its final checkpoint written)."""
        self._set_state(index, "gone")

    def stop_watching(self) -> None:
        """Stop the watcher (before the replay's actors are killed)."""
        self._stopping.set()

    # ------------------------------------------------------------ internals

    def _entry(self, index: int) -> dict[str, Any]:
        if index not in self._entries:
            raise ValueError(f"replay {self._replay!r} has shards 0..{len(self._entries) - 1}, "
                             f"not {index}")
        return self._entries[index]

    def _set_state(self, index: int, state: str) -> None:
        with self._lock:
            self._entry(index)["state"] = state

    def _watch(self) -> None:
        """Every :data:`WATCH_S`: ask each shard how it is (see the module docstring)."""
        while not self._stopping.wait(WATCH_S):
            with self._lock:
                indices = [i for i, e in self._entries.items()
                           if e["state"] not in ("draining", "gone")]
            asked: dict[int, Any] = {}
            for index in indices:
                try:
                    actor = ray.get_actor(shard_actor_name(self._replay, index),
                                          namespace=self._namespace)
                except ValueError:
                    continue  # not created yet (or killed): its creator reports it
                asked[index] = actor.describe.remote()
            deadline = time.monotonic() + ASK_S
            for index, ref in asked.items():
                self._learn(index, ref, max(0.0, deadline - time.monotonic()))

    def _learn(self, index: int, ref: Any, timeout: float) -> None:
        try:
            said = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return  # busy, not known dead: the next round asks again
        except ray.exceptions.ActorDiedError:
            self._set_state(index, "gone")
            return
        except ray.exceptions.RayError:  # ActorUnavailableError: Ray is restarting it
            with self._lock:
                entry = self._entries[index]
                if entry["state"] == "serving":
                    entry["state"] = "restarting"
            return
        if said["state"] == "serving":
            self.serving(index, said["incarnation"], said["address"], said["metrics_address"],
                         said["pid"], said["node_id"])
