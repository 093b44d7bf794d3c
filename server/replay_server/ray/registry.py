"""``ShardRegistry``: one replay's every expected shard, its address, state and incarnation.

One named Ray actor per replay (named as the replay, in its namespace)
holds an entry per shard index ``0..num_shards-1`` (the *expected* shards,
what clients are told the replay is), and while the replay grows
(``ReplayCluster.scale``) entries for the shards being added, which clients
are not told of until every one of them serves (:meth:`admit`):

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

Ray restarts the registry with the arguments it was first made with, so a
restarted registry expects the shard count of the replay's creation; one
that a scale grew since is learned back: the restarted registry looks for
the shard actors past that count (named ``<replay>.shard-<i>``, from the
first index it lacks) and expects each one that says it serves. A count a
scale down lowered cannot be learned from actors (a removed shard's absence
looks like one not started yet), so the registry also keeps its count in
Ray's key-value store (:func:`count_key`, in the GCS, which outlives the
actor) and a restarted registry takes a lower one from there.

Thread-safety: a threaded actor (calls run concurrently); every entry is read
and written under one lock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray

from replay_proto.id_layout import MAX_SHARDS  # the shard index's bits in every row id

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


KV_NAMESPACE = "replay-server"
"""The namespace of the registries' keys in Ray's key-value store."""


def count_key(namespace: str, replay: str) -> str:
    """The key under which replay ``replay``'s registry keeps its expected shard count."""
    return f"{namespace}/{replay}/expected_shards"


def _kv() -> Any:
    from ray.experimental import internal_kv  # the GCS's key-value store

    return internal_kv


def forget_count(namespace: str, replay: str) -> None:
    """Drop the kept count (the replay is shut down: a new one of that name starts afresh)."""
    _kv()._internal_kv_del(count_key(namespace, replay), namespace=KV_NAMESPACE)


def _new_entry(index: int) -> dict[str, Any]:
    return {"index": index, "state": "starting", "address": None, "metrics_address": None,
            "incarnation": 0, "pid": None, "node_id": None}


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
        self._expected = int(spec["num_shards"])
        self._entries = {i: _new_entry(i) for i in range(self._expected)}
        self._stopping = threading.Event()
        self._looking = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if self._looking:
            self._take_kept_count()
            self._learn_added()  # and again each watch until done
        else:
            self._keep_count()
        self._watcher = threading.Thread(target=self._watch, name="replay-registry-watch",
                                         daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------ reads

    def snapshot(self, adding: bool = False) -> dict[str, Any]:
        """``{"expected": n, "shards": [entry, ...]}`` in index order (plain data): the
        expected shards (``adding``: and those a scale is adding, not yet expected)."""
        with self._lock:
            listed = sorted(i for i in self._entries if adding or i < self._expected)
            return {"expected": self._expected,
                    "shards": [dict(self._entries[i]) for i in listed]}

    def spec(self) -> dict[str, Any]:
        """How the replay was created (``num_shards``: the expected shards now, after any
        scale; ``created_shards``, ``namespace``, tables, the shards' launch options)."""
        with self._lock:
            return {**self._spec, "num_shards": self._expected}

    # ------------------------------------------------------------ scale

    def add(self, num_shards: int, shard_options: list[dict[str, Any]]) -> list[int]:
        """Entries (``starting``) for shards ``expected..num_shards-1``, not yet expected,
        with their Ray options (``shard_options``, one per shard added, kept in the spec's
        ``launch`` for a later ``create`` that must start one again): the indices to start
        (an entry already there is kept: a scale asked again)."""
        with self._lock:
            indices = list(range(self._expected, num_shards))
            for index in indices:
                self._entries.setdefault(index, _new_entry(index))
            launch = self._spec.get("launch")
            if launch is not None:
                listed = list(launch["shard_options"])[:self._expected]
                self._spec["launch"] = {**launch, "shard_options": listed + list(shard_options)}
            return indices

    def admit(self, num_shards: int) -> None:
        """Expect ``num_shards`` shards from now on: clients resolving the replay take the
        added ones in. Idempotent.

        Raises:
            ValueError: a shard below ``num_shards`` does not serve (named), or
                ``num_shards`` is below the expected count.
        """
        with self._lock:
            if num_shards < self._expected:
                raise ValueError(f"replay {self._replay!r} expects {self._expected} shards; "
                                 f"admit({num_shards}) would drop some")
            late = [f"shard {i}: {self._entries[i]['state'] if i in self._entries else 'absent'}"
                    for i in range(self._expected, num_shards)
                    if self._entries.get(i, {}).get("state") != "serving"]
            if late:
                raise ValueError(f"replay {self._replay!r}: cannot expect {num_shards} shards "
                                 f"before they serve ({'; '.join(late)})")
            self._expected = num_shards
            self._keep_count()

    def retire(self, num_shards: int) -> list[int]:
        """Expect ``num_shards`` shards from now on, fewer than now (a scale down whose
        removed shards have handed their rows over): their entries are dropped, so clients
        resolving the replay drop them too. Idempotent: the indices dropped."""
        with self._lock:
            dropped = sorted(i for i in self._entries if i >= num_shards)
            for index in dropped:
                del self._entries[index]
            self._expected = min(self._expected, num_shards)
            self._keep_count()
            launch = self._spec.get("launch")
            if launch is not None:
                self._spec["launch"] = {**launch,
                                        "shard_options": list(launch["shard_options"])[
                                            :num_shards]}
            return dropped

    def abandon(self) -> list[int]:
        """Forget the entries of shards added but not admitted (a scale that failed): their
        indices."""
        with self._lock:
            dropped = sorted(i for i in self._entries if i >= self._expected)
            for index in dropped:
                del self._entries[index]
            return dropped

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

    def _keep_count(self) -> None:
        _kv()._internal_kv_put(count_key(self._namespace, self._replay), str(self._expected),
                               namespace=KV_NAMESPACE)

    def _take_kept_count(self) -> None:
        """A restarted registry: a count a scale down lowered (see the module docstring)."""
        kept = _kv()._internal_kv_get(count_key(self._namespace, self._replay),
                                      namespace=KV_NAMESPACE)
        if kept is None or int(kept) >= self._expected:
            return
        self.retire(int(kept))

    def _learn_added(self) -> None:
        """A restarted registry: expect the shards a scale added since the replay was
        created (each serving shard actor past the count it was made with, in index order).
        Done (``_looking`` cleared) at the first index with no actor, or one that says it
        does not serve (draining, gone); one that cannot answer now is asked next watch."""
        while self._expected < MAX_SHARDS:
            index = self._expected
            try:
                actor = ray.get_actor(shard_actor_name(self._replay, index),
                                      namespace=self._namespace)
            except ValueError:
                break  # no such shard: every added one is learned
            ref: Any = actor.describe.remote()
            try:
                said: dict[str, Any] = ray.get(ref, timeout=ASK_S)
            except ray.exceptions.ActorDiedError:
                break
            except (ray.exceptions.RayError, TimeoutError):
                return  # restarting or busy: asked again at the next watch
            if said["state"] != "serving":
                break
            with self._lock:
                self._entries[index] = _new_entry(index)
                self._expected = index + 1
            self.serving(index, said["incarnation"], said["address"], said["metrics_address"],
                         said["pid"], said["node_id"])
        self._looking = False

    def _watch(self) -> None:
        """Every :data:`WATCH_S`: ask each shard how it is (see the module docstring)."""
        while not self._stopping.wait(WATCH_S):
            if self._looking:
                self._learn_added()
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
