"""TorchRL's buffer classes, swapped: ``RemoteReplayBuffer`` on a table that matches.

What a TorchRL user does to swap: build the server table their storage and
sampler describe (:func:`replay_client.torchrl.components.request_of` says
which), and pass the rest of their arguments to ``RemoteReplayBuffer``. The
classes here do exactly that for each buffer a test builds, with TorchRL's
constructor signatures (keyword-only, ``alpha``/``beta`` required for the
prioritized ones):

* storage, sampler, writer, ``alpha`` and ``beta`` pick (or start) the server
  table; they are also passed on when ``RemoteReplayBuffer`` takes them;
* every other argument goes to ``RemoteReplayBuffer`` when it takes it (by
  name, or through its ``**options``, where it refuses what it cannot do); one
  it does not take fails the test (:class:`NoSuchArgument`) unless the test
  left it at TorchRL's default.

The plain classes (``ReplayBuffer``, ``PrioritizedReplayBuffer``) pass
``include_info=False`` (samples are the data alone, as TorchRL's) when
``RemoteReplayBuffer`` takes it. An attribute the buffer lacks is recorded
(the report names it) and raises ``AttributeError`` as it would.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.conformance.servers import ServerPool

CLIENT_TIMEOUT_S = 5.0
"""Seconds each client call may take (a sample that waits on an empty table, too)."""

TORCHRL_DEFAULTS: dict[str, Any] = {
    "collate_fn": None, "pin_memory": False, "prefetch": None, "transform": None,
    "transform_factory": None, "batch_size": None, "dim_extend": None, "checkpointer": None,
    "generator": None, "consume_after_n_samples": None, "shared": False, "compilable": None,
    "delayed_init": None, "service_backend": "direct", "service_backend_options": None,
    "transport": "auto", "transport_options": None, "priority_key": "td_error",
    "eps": 1e-8, "dtype": torch.float, "reduction": "max", "sample_unit": None,
}
"""TorchRL's constructor defaults: such an argument need not exist on our side."""

COMPONENTS = ("storage", "sampler", "writer", "alpha", "beta")


class NoSuchArgument(TypeError):
    """A TorchRL constructor argument ``RemoteReplayBuffer`` does not take."""


_POOL: ServerPool | None = None


def pool() -> ServerPool:
    global _POOL
    if _POOL is None:
        workdir = Path(os.environ.get("CONFORMANCE_WORKDIR") or tempfile.mkdtemp("conformance"))
        workdir.mkdir(parents=True, exist_ok=True)
        _POOL = ServerPool(os.environ["CONFORMANCE_SERVER_PYTHON"], workdir)
    return _POOL


def between_tests() -> None:
    if _POOL is not None:
        _POOL.trim()


def shutdown() -> None:
    if _POOL is not None:
        _POOL.close()


def _reset_with_schema(address: str, table: str) -> None:
    from replay_client import ReplayClient

    client = ReplayClient(address, timeout=CLIENT_TIMEOUT_S)
    try:
        client.reset(table, schema=True)
    finally:
        client.close()


def _can_reset_schema() -> bool:
    from replay_client import ReplayClient

    return "schema" in inspect.signature(ReplayClient.reset).parameters


def remote_classes(record: Any) -> dict[str, type]:
    """The four swapped classes, recording builds and missing attributes in ``record``."""
    from replay_client import RemoteReplayBuffer, ReplayClient
    from replay_client.torchrl.components import request_of

    parameters = inspect.signature(RemoteReplayBuffer.__init__).parameters
    accepted = set(parameters) - {"self"}
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    reset = _reset_with_schema if _can_reset_schema() else None

    def build(self: Any, kwargs: dict[str, Any], include_info: bool) -> None:
        record.built(kwargs)
        request = request_of(**{k: kwargs.get(k) for k in COMPONENTS},
                             batch_size=kwargs.get("batch_size"))
        address, table = pool().table(request.config(), reset)
        passed: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in accepted or (takes_options and name not in COMPONENTS):
                passed[name] = value
            elif name in COMPONENTS:
                continue  # the table stands for it
            elif name in TORCHRL_DEFAULTS and _same(value, TORCHRL_DEFAULTS[name]):
                continue
            elif os.environ.get("CONFORMANCE_DROP_UNKNOWN_ARGS"):
                continue  # measuring an older buffer: what it does without the argument
            else:
                raise NoSuchArgument(f"RemoteReplayBuffer takes no argument {name!r} "
                                     f"(got {value!r})")
        if "include_info" in accepted:
            passed["include_info"] = include_info
        client = ReplayClient(address, timeout=CLIENT_TIMEOUT_S)
        RemoteReplayBuffer.__init__(self, client, table, **passed)

    def missing(self: Any, name: str) -> Any:
        if not name.startswith("__") and "replay_client" in self.__dict__:  # built, and asked for it
            record.missing.append(name)
        raise AttributeError(f"{type(self).__name__} (RemoteReplayBuffer) has no attribute "
                             f"{name!r}")

    def plain_init(self: Any, **kwargs: Any) -> None:
        build(self, kwargs, include_info=False)

    def tensordict_init(self: Any, **kwargs: Any) -> None:
        build(self, kwargs, include_info=True)

    def prioritized_init(self: Any, *, alpha: float, beta: float, **kwargs: Any) -> None:
        build(self, {"alpha": alpha, "beta": beta, **kwargs}, include_info=False)

    def tensordict_prioritized_init(self: Any, *, alpha: float, beta: float,
                                    **kwargs: Any) -> None:
        build(self, {"alpha": alpha, "beta": beta, **kwargs}, include_info=True)

    def make(name: str, bases: tuple[type, ...], init: Any) -> type:
        return type(name, bases, {"__init__": init, "__getattr__": missing,
                                  "__module__": "tests.conformance.swap", "__qualname__": name})

    plain = make("ReplayBuffer", (RemoteReplayBuffer,), plain_init)
    tensordict = make("TensorDictReplayBuffer", (plain,), tensordict_init)
    prioritized = make("PrioritizedReplayBuffer", (plain,), prioritized_init)
    tensordict_prioritized = make("TensorDictPrioritizedReplayBuffer", (tensordict,),
                                  tensordict_prioritized_init)
    return {cls.__name__: cls for cls in (plain, tensordict, prioritized,
                                          tensordict_prioritized)}


def _same(value: Any, default: Any) -> bool:
    try:
        return value is default or bool(value == default)
    except (TypeError, ValueError, RuntimeError):  # tensors, objects without a boolean ==
        return False
