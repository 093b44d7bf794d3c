"""``ReplayCluster``: a sharded replay on a Ray cluster, started, found and stopped in one call.

::

    replay = ReplayCluster.create("replay", tables=[{"name": "replay", "capacity": 100_000,
                                                     "sampler": "prioritized"}],
                                  num_shards=2, checkpoint_dir="/shared/checkpoints")
    client = replay.client()          # an ordinary ReplayClient over the shards; pickles
    ray.get(actor_loop.remote(client))  # into tasks and actors, which find the shards

The replay is a registry actor (:class:`~replay_server.ray.registry.ShardRegistry`,
named as the replay) and ``num_shards`` shard actors
(:class:`~replay_server.ray.shard.ReplayShard`, ``<name>.shard-<i>``), all
detached (they outlive the driver that made them) in ``namespace``. Clients
find them by ``ray://<namespace>/<name>``
(:mod:`replay_client.sharded.ray_registry`): the registry lists every expected
shard with its state, so a client never takes the shards serving for the whole
replay. Ray restarts a shard that dies (``max_restarts``); it restores its
last checkpoint and registers again, and open clients and streams take it back.
:meth:`ReplayCluster.scale` grows a running replay: the new shards join the
registry's expected count once they serve, and open clients and streams take
them in at their next resolution. A scale down drains the shards removed and moves
their rows to the shards that stay (:meth:`ReplayCluster.scale`).

Thread-safety: a ``ReplayCluster`` is a handle (names and actor handles); it
may be used from any thread and pickled into tasks.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from replay_client import ReplayClient
from replay_proto.scalars import is_int
from replay_server.errors import ConfigError
from replay_server.ray.registry import (
    MAX_SHARDS,
    ShardRegistry,
    ask,
    forget_count,
    shard_actor_name,
)
from replay_server.ray.handover import counted, kept_message, unanswered_message
from replay_server.ray.shard import ReplayShard, shard_settings
from replay_server import grpc_experiments

DEFAULT_NAMESPACE = "replay"
"""The Ray namespace of a replay's actors unless ``namespace=`` names another."""

PLACEMENT = {"SPREAD": "SPREAD", "DEFAULT": "DEFAULT", "PACK": "DEFAULT"}
"""``placement_strategy`` -> the shard actors' Ray ``scheduling_strategy``."""

RESOLVE_INTERVAL_S = 5.0
"""How often a client made by :meth:`ReplayCluster.client` asks the registry for the shards
again (unless ``resolve_interval_s=`` says otherwise): how soon added shards join it."""

_GONE_WAIT_S = 30.0  # how long shutdown waits for Ray to release the actors' names


class ReplayExistsError(ConfigError):
    """``create(..., get_if_exists=False)`` named a replay that exists, or an existing replay
    was asked for with another number of shards or other tables."""


class ScaleDownError(ConfigError):
    """A scale down could not move a removed shard's rows to the shards that stay (the
    message names the shard and why); see :meth:`ReplayCluster.scale`."""


class ReplayNotFoundError(ConfigError):
    """``ReplayCluster.get`` named no replay (no registry actor under that name)."""


class ReplayCluster:
    """A handle on a replay running as Ray actors. Made by :meth:`create` or :meth:`get`."""

    def __init__(self, name: str, namespace: str, registry: Any, num_shards: int) -> None:
        self.name = name
        self.namespace = namespace
        self.num_shards = num_shards
        self._registry = registry

    # ------------------------------------------------------------ start, find

    @classmethod
    def create(cls, name: str, tables: Sequence[Any], num_shards: int = 1, *,
               shard_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
               placement_strategy: str = "SPREAD", checkpoint_dir: str | None = None,
               checkpoint_interval_s: float = 60.0, max_restarts: int = -1,
               server: Mapping[str, Any] | None = None,
               registry_options: Mapping[str, Any] | None = None,
               namespace: str = DEFAULT_NAMESPACE,
               get_if_exists: bool = True, timeout_s: float = 120.0) -> ReplayCluster:
        """Start replay ``name``: a registry and ``num_shards`` shards, each serving ``tables``.

        Args:
            name: the replay's name (its registry actor's; clients use
                ``ray://<namespace>/<name>``).
            tables: ``[[tables]]`` entries as ``replay.toml`` parses them (``{"name": "replay",
                "capacity": 100_000, "sampler": "prioritized"}``) or ``TableConfig`` objects;
                every shard serves them all.
            num_shards: shards (1..128).
            shard_options: Ray actor options of the shards (``num_cpus``, ``resources``,
                ``memory``, ``scheduling_strategy``, ...): one dict for all, or a list of one
                per shard.
            placement_strategy: ``"SPREAD"`` (shards on as many nodes as Ray can) or
                ``"PACK"``/``"DEFAULT"`` (Ray's default placement); a ``scheduling_strategy`` in
                ``shard_options`` overrides it.
            checkpoint_dir: root of the shards' checkpoints (``<dir>/<name>/shard-<i>``), on
                storage every node can read; ``None``: no persistence (a restarted shard starts
                empty).
            checkpoint_interval_s: seconds between a shard's timed checkpoints (a crash loses
                the rows since its last one); 0: only on request and at shutdown.
            max_restarts: how often Ray restarts a shard that dies (-1: always).
            server: ``[server]`` keys for every shard (``address`` defaults to the node's IP,
                port 0; ``metrics_address`` likewise).
            registry_options: Ray actor options of the registry (it takes no CPU; ``resources``
                can keep it on a node you trust, such as the head: Ray restarts it elsewhere if
                its node is lost, and it learns the shards back from them).
            namespace: the Ray namespace of the replay's actors.
            get_if_exists: a replay of that name exists (a driver that failed after starting
                it): return it (missing shards started) instead of refusing.
            timeout_s: how long to wait for every shard to serve.

        Raises:
            ConfigError: a bad argument or table (named), before any actor starts.
            ReplayExistsError: the replay exists and ``get_if_exists`` is false, or it exists
                with another number of shards or other tables (each difference named).
            TimeoutError: the shards did not all serve within ``timeout_s``.
        """
        _check_launch(num_shards, placement_strategy, max_restarts)
        server = {**(server or {}), "checkpoint_interval_s": checkpoint_interval_s}
        settings = shard_settings(0, bind_host="127.0.0.1", server=server,  # checked here
                                  tables=tables, checkpoint_dir=checkpoint_dir, replay=name)
        launch = {"server": server, "checkpoint_dir": checkpoint_dir,
                  "max_restarts": max_restarts, "strategy": PLACEMENT[placement_strategy],
                  "shard_options": _per_shard(shard_options, num_shards)}
        spec = {"num_shards": num_shards, "created_shards": num_shards, "namespace": namespace,
                "tables": list(settings.tables), "launch": launch}
        registry = _registry(name, namespace, spec, registry_options, get_if_exists)
        running = ask(registry, "spec")
        _check_same(name, running, spec)
        count = running["num_shards"]  # more than asked where a scale grew it since
        _start_shards(name, namespace, range(count), {**launch, **running.get("launch", {}),
                                                      "tables": spec["tables"]})
        cluster = cls(name, namespace, registry, count)
        cluster.wait_serving(timeout_s)
        return cluster

    @classmethod
    def get(cls, name: str, namespace: str = DEFAULT_NAMESPACE) -> ReplayCluster:
        """The running replay ``name`` (started by any driver).

        Raises:
            ReplayNotFoundError: there is no such replay.
        """
        registry = _registry_of(name, namespace)
        if registry is None:
            raise ReplayNotFoundError(f"no replay {name!r} in Ray namespace {namespace!r}")
        return cls(name, namespace, registry, ask(registry, "spec")["num_shards"])

    # ------------------------------------------------------------ use

    @property
    def address(self) -> str:
        """What clients connect to: ``ray://<namespace>/<name>``."""
        return f"ray://{self.namespace}/{self.name}"

    def client(self, **client_options: Any) -> Any:
        """An ordinary sharded ``ReplayClient`` over the shards (``allow_degraded``,
        ``wait_for_shards_s``, ``timeout``, ... as there); it pickles into Ray tasks and
        actors, which find the shards through the registry.

        ``resolve_interval_s`` defaults to :data:`RESOLVE_INTERVAL_S` here (a
        ``ray://`` resolution is one call to the registry): shards that
        :meth:`scale` adds join the client, and its streams, within it."""
        client_options.setdefault("resolve_interval_s", RESOLVE_INTERVAL_S)
        return ReplayClient(self.address, **client_options)

    @property
    def shards(self) -> list[Any]:
        """The shard actors' handles, in index order."""
        return [ray.get_actor(shard_actor_name(self.name, i), namespace=self.namespace)
                for i in range(self.num_shards)]

    def states(self) -> list[dict[str, Any]]:
        """Every shard as the registry knows it: index, state, address, metrics address,
        incarnation, pid, node id."""
        return ask(self._registry, "snapshot")["shards"]

    def registry(self) -> dict[str, Any]:
        """Where the registry actor runs: ``pid`` and ``node_id``."""
        return ask(self._registry, "describe")

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Wait until every shard serves.

        Raises:
            TimeoutError: some did not within ``timeout_s`` (named, with their states).
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            states = self.states()
            if all(s["state"] == "serving" for s in states):
                return
            if time.monotonic() >= deadline:
                late = [f"shard {s['index']}: {s['state']}" for s in states
                        if s["state"] != "serving"]
                raise TimeoutError(f"replay {self.name!r}: not every shard serves after "
                                   f"{timeout_s:g} s ({'; '.join(late)})")
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    # ------------------------------------------------------------ scale

    def scale(self, num_shards: int, *,
              shard_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
              timeout_s: float = 120.0) -> dict[int, dict[str, Any]]:
        """Grow (or shrink) the running replay to ``num_shards`` shards.

        Shards ``n..num_shards-1`` (``n``: the shards now) start with the tables and options the
        replay was created with; the registry expects them only once every one of them serves,
        so no client ever counts a shard it cannot reach yet. Open clients, their streams
        included, take them in at their next resolution of ``ray://`` (every
        ``resolve_interval_s``: :meth:`client` sets 5 s), and from then on spread their inserts
        over every shard and sample from all of them. Rows already stored stay on their shards
        (ids are never moved: each shard has its own id space). A scale asked again (say, after
        a driver failed in one) finishes it.

        Scaling down (``num_shards`` below the shards now) keeps every row in the replay. Shards
        ``num_shards..n-1`` drain (their registry entries say ``draining``: clients treat them
        as during a restart: a strict client's calls that need them fail naming them, degraded
        ones list them in ``missing_shards``; no client samples the shards that stay as the
        whole replay meanwhile), write their final checkpoints, and insert their rows, with
        their priorities and in the order written (each episode to one shard), into the shards
        that stay (:mod:`~replay_server.ray.handover`). Then the registry expects
        ``num_shards``: clients and streams drop the removed shards at their next resolution,
        and from then on their samples are exact over every row, the moved ones included. The
        moved rows have new ids: a priority update naming an old id is skipped and counted
        (``skipped_updates``), as an update of an overwritten row is. An insert a client sends
        to a removed shard after it stopped (before that client resolved again) gets
        ``UnavailableError`` from a strict client (degraded ones resend it to the shards that
        stay). The removed shards' checkpoint folders are set aside
        (``shard-<i>.retired-<time>``), and their actors stopped.

        Args:
            num_shards: the shard count wanted (1..128; the count now: nothing to do).
            shard_options: the new shards' Ray options: one dict for all, or a list with one per
                new shard. ``None``: those given at ``create`` (a list there: entry ``i % len``
                for shard ``i``).
            timeout_s: how long to wait for the new shards to serve (scaling down: for each
                removed shard's hand-over).

        Returns:
            Scaling down: per removed shard, ``{"moved": {table: rows}, "retired_checkpoints":
            path or None}``; otherwise ``{}``.

        Raises:
            ConfigError: ``num_shards`` or ``shard_options`` is bad (named); nothing started.
            ScaleDownError: a table whose rows leave when sampled (a queue,
                ``max_times_sampled``) or a staying shard that does not serve: nothing changed.
                Or a removed shard could not hand its rows over (named, with why): the replay
                keeps every shard, each serving, every row stored once (the rows moved stay
                where they went; the removed shards serve again with the rest,
                :mod:`~replay_server.ray.handover`), and the same scale asked again moves the
                rest. A removed shard that did not answer (its actor died) is named as such:
                its restart restores its final checkpoint, the rows it had moved included.
            TimeoutError: the new shards did not all serve within ``timeout_s`` (their states
                named); they are stopped and the replay keeps its shards.
        """
        _check_shard_count(num_shards, "scale: ")
        spec = ask(self._registry, "spec")
        now = spec["num_shards"]
        if num_shards < now:
            if shard_options is not None:
                raise ConfigError(f"scale({num_shards}) removes shards: shard_options has "
                                  f"nothing to apply to")
            return self._shrink(num_shards, now, timeout_s)
        self._grow(spec, num_shards, now, shard_options, timeout_s)
        self.num_shards = num_shards
        return {}

    def _grow(self, spec: dict[str, Any], num_shards: int, now: int,
              shard_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
              timeout_s: float) -> None:
        """Scale up from ``now`` to ``num_shards`` shards (see :meth:`scale`): start the new
        shards with the replay's launch options, and admit them once every one serves (the
        count now: the options are checked, nothing starts)."""
        if "launch" not in spec:
            raise ConfigError(f"replay {self.name!r} was started by a version that did not "
                              f"keep its shards' options: it cannot be scaled")
        launch = {**spec["launch"], "tables": spec["tables"]}
        new = _new_shard_options(shard_options, launch["shard_options"], now, num_shards)
        if num_shards == now:
            return
        indices = ask(self._registry, "add", num_shards, new)
        _start_shards(self.name, self.namespace, indices,
                      {**launch, "shard_options": [*launch["shard_options"][:now], *new]})
        try:
            self._wait_added(num_shards, timeout_s)
        except TimeoutError:
            self._abandon(indices)
            raise
        ask(self._registry, "admit", num_shards)

    def _shrink(self, num_shards: int, now: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Scale down from ``now`` to ``num_shards`` shards (see :meth:`scale`): what each
        removed shard handed over."""
        removing = [t.name for t in ask(self._registry, "spec").get("tables", [])
                    if t.removal_limit]
        if removing:
            raise ScaleDownError(f"replay {self.name!r}: scale({num_shards}) cannot move the "
                                 f"rows of {removing}: rows leave those tables when sampled "
                                 f"(fifo/lifo, max_times_sampled), so they are not moved; "
                                 f"nothing was changed")
        listed = {s["index"]: s for s in ask(self._registry, "snapshot")["shards"]}
        staying = [listed[i]["address"] for i in range(num_shards)]
        if any(listed[i]["state"] != "serving" for i in range(num_shards)):
            raise ScaleDownError(f"replay {self.name!r}: scale({num_shards}) needs shards "
                                 f"0..{num_shards - 1} serving to take the rows; "
                                 + "; ".join(f"shard {i}: {listed[i]['state']}"
                                             for i in range(num_shards)))
        removed = {i: ray.get_actor(shard_actor_name(self.name, i), namespace=self.namespace)
                   for i in range(num_shards, now)}
        grace = min(10.0, timeout_s)
        handing: dict[int, Any] = {i: h.hand_over.remote(staying, grace)
                                   for i, h in removed.items()}
        handed: dict[int, dict[str, Any]] = {}
        failed: dict[int, str] = {}
        for index, ref in handing.items():
            try:
                handed[index] = ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                failed[index] = unanswered_message(index, exc)
                continue
            if "failure" in handed[index]:
                failed[index] = kept_message(index, handed.pop(index))
        if failed:
            raise ScaleDownError(f"replay {self.name!r}: scale({num_shards}) failed, the "
                                 f"replay keeps its {now} shards: "
                                 + "; ".join(failed[i] for i in sorted(failed))
                                 + self._resumed(removed, handed)
                                 + f"; scale({num_shards}) again once the cause is fixed "
                                 f"moves the rest")
        ask(self._registry, "retire", num_shards)
        for handle in removed.values():
            ray.kill(handle, no_restart=True)
        names = [shard_actor_name(self.name, i) for i in removed]
        deadline = time.monotonic() + _GONE_WAIT_S
        while any(_exists(n, self.namespace) for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.num_shards = num_shards
        return handed

    def _resumed(self, removed: Mapping[int, Any], handed: Mapping[int, Any]) -> str:
        """Have the removed shards that handed every row over serve again (empty) when
        another one failed, so the replay serves as many shards as it expects: what to add
        to the error."""
        said = []
        for index in sorted(handed):
            try:
                ray.get(removed[index].resume.remote())
                said.append(f"; shard {index} moved all its rows "
                            f"({counted(handed[index]['moved'])}) and serves again, empty")
            except ray.exceptions.RayError as exc:
                said.append(f"; shard {index} moved all its rows but could not serve again "
                            f"({type(exc).__name__}: {exc}): clients find it down")
        return "".join(said)

    def _wait_added(self, num_shards: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            added = [s for s in ask(self._registry, "snapshot", True)["shards"]
                     if s["index"] < num_shards]
            if all(s["state"] == "serving" for s in added):
                return
            if time.monotonic() >= deadline:
                late = [f"shard {s['index']}: {s['state']}" for s in added
                        if s["state"] != "serving"]
                raise TimeoutError(f"replay {self.name!r}: scale({num_shards}): not every new "
                                   f"shard serves after {timeout_s:g} s ({'; '.join(late)}); "
                                   f"they are stopped, the replay keeps its shards")
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _abandon(self, indices: Sequence[int]) -> None:
        """Stop the shards a failed scale started and forget their entries."""
        for index in indices:
            try:
                ray.kill(ray.get_actor(shard_actor_name(self.name, index),
                                       namespace=self.namespace), no_restart=True)
            except ValueError:
                continue
        ask(self._registry, "abandon")

    def checkpoint(self) -> dict[int, str]:
        """A checkpoint of every shard now: shard index -> the checkpoint's path."""
        with self.client() as client:
            return client.checkpoint()

    # ------------------------------------------------------------ stop

    def shutdown(self, grace: float = 10.0) -> None:
        """Drain every shard (in-flight calls finish within ``grace``, then its final
        checkpoint), then kill the shards and the registry: no actor, name or process of
        the replay is left. Idempotent."""
        count = self.num_shards
        try:  # a handle made before a scale: the registry knows every shard
            listed = ask(self._registry, "snapshot", True, timeout_s=10.0)["shards"]
            count = max([count, *(s["index"] + 1 for s in listed)])
        except ray.exceptions.RayError:
            pass  # the registry is gone: the shards this handle knows
        handles = {}
        for index in range(count):
            try:
                handles[index] = ray.get_actor(shard_actor_name(self.name, index),
                                               namespace=self.namespace)
            except ValueError:
                continue
        try:
            ray.get(self._registry.stop_watching.remote())
        except ray.exceptions.RayError:
            pass  # already gone
        drains: list[Any] = [h.drain.remote(grace) for h in handles.values()]
        for ref in drains:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass  # a shard that died meanwhile has nothing to drain
        for handle in [*handles.values(), self._registry]:
            ray.kill(handle, no_restart=True)
        forget_count(self.namespace, self.name)
        names = [self.name, *(shard_actor_name(self.name, i) for i in range(count))]
        deadline = time.monotonic() + _GONE_WAIT_S
        while any(_exists(n, self.namespace) for n in names):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"replay {self.name!r}: Ray still lists "
                                   f"{[n for n in names if _exists(n, self.namespace)]} "
                                   f"{_GONE_WAIT_S:g} s after they were killed")
            time.sleep(0.05)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReplayCluster, (self.name, self.namespace, self._registry, self.num_shards))


def _check_shard_count(num_shards: Any, call: str = "") -> None:
    """Refuse a shard count that is not an integer in 1..MAX_SHARDS (what ids can tell apart)."""
    if not is_int(num_shards) or not 1 <= num_shards <= MAX_SHARDS:
        raise ConfigError(f"{call}num_shards must be an integer in 1..{MAX_SHARDS}, got "
                          f"{num_shards!r}")


def _check_launch(num_shards: Any, placement_strategy: Any, max_restarts: Any) -> None:
    """Refuse :meth:`ReplayCluster.create`'s bad shard count, placement or restart count."""
    _check_shard_count(num_shards)
    if placement_strategy not in PLACEMENT:
        raise ConfigError(f"placement_strategy must be one of {sorted(PLACEMENT)}, got "
                          f"{placement_strategy!r}")
    if not is_int(max_restarts) or max_restarts < -1:
        raise ConfigError(f"max_restarts must be an integer >= -1, got {max_restarts!r}")


def _check_same(name: str, running: Mapping[str, Any], asked: Mapping[str, Any]) -> None:
    """Refuse to hand back a running replay other than the one asked for: another shard
    count (but the count it was created with, which ``scale`` changed since, is the same
    replay: it is handed back with its shards now, never rescaled), or tables that
    differ (each difference named, as ``table 'u': capacity 100 running, 200 asked``). A registry started before the spec held tables has none to
    compare.

    Raises:
        ReplayExistsError: the running replay differs.
    """
    scaled = running.get("created_shards") == asked["num_shards"]  # since grown or shrunk
    if running["num_shards"] != asked["num_shards"] and not scaled:
        note = (f" (created with {running['created_shards']}, then scaled)"
                if running.get("created_shards", running["num_shards"]) != running[
                    "num_shards"] else "")
        raise ReplayExistsError(f"replay {name!r} exists with {running['num_shards']} "
                                f"shards{note}, not {asked['num_shards']}")
    if "tables" not in running:
        return
    had = {table.name: table for table in running["tables"]}
    wanted = {table.name: table for table in asked["tables"]}
    problems = [f"table {n!r} is not running" for n in sorted(wanted.keys() - had.keys())]
    problems += [f"table {n!r} runs but was not asked for" for n in sorted(had.keys()
                                                                           - wanted.keys())]
    for table_name in sorted(had.keys() & wanted.keys()):
        old, new = had[table_name], wanted[table_name]
        problems += [f"table {table_name!r}: {f.name} {_shown(getattr(old, f.name))} "
                     f"running, {_shown(getattr(new, f.name))} asked"
                     for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(
                         new, f.name)]
    if problems:
        raise ReplayExistsError(f"replay {name!r} exists with other tables ("
                                + "; ".join(problems) + "): shut it down first "
                                "(ReplayCluster.get(name).shutdown()) or use another name")


def _shown(value: Any) -> str:
    """A config value as the user wrote it: a sampler or storage kind as its plain name."""
    if isinstance(value, enum.Enum):
        value = value.value
    return repr(str.__str__(value) if isinstance(value, str) else value)


def _per_shard(options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
               num_shards: int) -> list[dict[str, Any]]:
    """One dict of Ray actor options per shard."""
    if options is None:
        return [{} for _ in range(num_shards)]
    if isinstance(options, Mapping):
        return [dict(options) for _ in range(num_shards)]
    listed = [dict(o) for o in options]
    if len(listed) != num_shards:
        raise ConfigError(f"shard_options is a list of {len(listed)} dicts for {num_shards} "
                          f"shards (give one dict for all, or one per shard)")
    reserved = {"name", "namespace", "lifetime", "get_if_exists", "max_restarts"}
    for index, entry in enumerate(listed):
        if reserved & set(entry):
            raise ConfigError(f"shard_options[{index}] sets {sorted(reserved & set(entry))}, "
                              f"which the replay sets itself")
    return listed


def _registry(name: str, namespace: str, spec: dict[str, Any],
              options: Mapping[str, Any] | None, get_if_exists: bool) -> Any:
    """The registry actor of replay ``name``: the running one, else a new one holding
    ``spec`` (detached, restarted by Ray whenever it dies).

    Raises:
        ReplayExistsError: it runs and ``get_if_exists`` is false.
    """
    if not get_if_exists and _registry_of(name, namespace) is not None:
        raise ReplayExistsError(f"a replay {name!r} exists in Ray namespace {namespace!r}; "
                                f"ReplayCluster.get({name!r}) returns it (or pass "
                                f"get_if_exists=True)")
    return ray.remote(ShardRegistry).options(**{
        "num_cpus": 0, **(options or {}), "name": name, "namespace": namespace,
        "lifetime": "detached", "get_if_exists": True, "max_restarts": -1,
        "max_concurrency": 16}).remote(name, namespace, spec)


def _registry_of(name: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _exists(name: str, namespace: str) -> bool:
    return _registry_of(name, namespace) is not None


def _start_shards(name: str, namespace: str, indices: Sequence[int] | range,
                  launch: Mapping[str, Any]) -> None:
    """Start (or find: ``get_if_exists``) shard actors ``indices`` with ``launch``'s options
    (``server``, ``tables``, ``checkpoint_dir``, ``max_restarts``, ``strategy``, and
    ``shard_options``: one dict per shard, entry ``i % len`` past its end)."""
    shard_class = ray.remote(ReplayShard)
    listed = launch["shard_options"]
    for index in indices:
        options = {"scheduling_strategy": launch["strategy"], **listed[index % len(listed)],
                   "name": shard_actor_name(name, index), "namespace": namespace,
                   "lifetime": "detached", "get_if_exists": True,
                   "max_restarts": launch["max_restarts"], "max_concurrency": 4}
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = grpc_experiments.for_a_child(runtime_env.get("env_vars"))
        options["runtime_env"] = runtime_env
        shard_class.options(**options).remote(name, namespace, index, launch["server"],
                                              list(launch["tables"]), launch["checkpoint_dir"])


def _new_shard_options(options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                       created: Sequence[Mapping[str, Any]], now: int,
                       wanted: int) -> list[dict[str, Any]]:
    """The Ray options of shards ``now..wanted-1`` (see ``ReplayCluster.scale``)."""
    if options is None:
        return [dict(created[i % len(created)]) for i in range(now, wanted)]
    try:
        return _per_shard(options, wanted - now)
    except ConfigError as exc:
        raise ConfigError(f"scale: {exc}") from None
