"""gRPC core experiments the server turns off, and why: the one place that says so.

gRPC core ships new behaviour as named "experiments", on by default once trusted, read once
per process from the ``GRPC_EXPERIMENTS`` environment variable (``-name`` turns one off)
when gRPC starts: the variable must be set before ``grpc`` is imported, and nothing can
change it in a process that has imported ``grpc`` already.

``optimization_04`` (on by default since grpcio 1.82; still in 1.85.3) breaks a server under
an HTTP/2 rapid-reset flood: a call arriving on *another* connection while the flooder's
reset streams are being torn down is cancelled by gRPC core before any handler sees it (the
client gets CANCELLED, the server logs nothing). Reproduced with a plain ``grpc.aio`` server
and with ``grpc.server`` (a flood of 1,000 reset streams, then one call: CANCELLED within a
few floods, 2-of-2 runs on each of 1.82.3, 1.83.2, 1.84.2 and 1.85.3; 0 in 150 floods x 3
with the experiment off, and 0 on 1.70-1.81, which do not have it). For the replay server it
meant an actor's insert failing (inserts are not retried: they are not safe to repeat) while
someone else flooded the port.

Importing ``replay_server`` turns the experiment off (:func:`turn_off`) unless ``grpc`` is
imported already: ``replay-server serve`` always, an embedded server when the package comes
first; the Ray shards get the variable in their actors' environment (:func:`for_a_child`).
A process that imported ``grpc`` first cannot, and its server says so in its start-up log
(:func:`state`): start that process with ``GRPC_EXPERIMENTS=-optimization_04``. Importing
this module imports no gRPC (``importlib.metadata`` tells the version).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata

VARIABLE = "GRPC_EXPERIMENTS"

BROKEN: dict[str, tuple[int, int]] = {
    # name -> the first grpcio (major, minor) that has it on by default
    "optimization_04": (1, 82),
}
"""Experiments that cancel legitimate calls (see the module docstring), by name."""


def grpc_version() -> tuple[int, int] | None:
    """The installed grpcio's (major, minor), read from its metadata (no import); ``None``
    if it cannot be told."""
    try:
        major, minor = metadata.version("grpcio").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def affecting(version: tuple[int, int] | None) -> list[str]:
    """The broken experiments that ``version`` of grpcio has (older ones do not know the
    names: naming one there makes gRPC log "Unknown experiment" at start)."""
    if version is None:
        return []
    return [name for name, since in BROKEN.items() if version >= since]


def _named(value: str) -> set[str]:
    """The experiments a ``GRPC_EXPERIMENTS`` value names, turned on or off."""
    return {part.strip().lstrip("-") for part in value.split(",") if part.strip()}


def turn_off(environ: MutableMapping[str, str] | None = None,
             version: tuple[int, int] | None = None,
             grpc_imported: bool | None = None) -> list[str]:
    """Add ``-name`` to ``GRPC_EXPERIMENTS`` for each broken experiment the installed grpcio
    has, keeping what the variable says already (an experiment it names, on or off, is the
    operator's choice and left alone); the names turned off now.

    Does nothing once ``grpc`` is imported (``grpc_imported``, default: it is in
    ``sys.modules``): gRPC has read the variable then, and changing it would only make
    :func:`state` report a workaround that is not in force. Not thread-safe (it writes
    the process environment): call it at start-up.
    """
    environ = os.environ if environ is None else environ
    version = grpc_version() if version is None else version
    if grpc_imported is None:
        grpc_imported = "grpc" in sys.modules
    current = environ.get(VARIABLE, "")
    added = [name for name in affecting(version) if name not in _named(current)]
    if added and not grpc_imported:
        parts = [part for part in current.split(",") if part.strip()]
        environ[VARIABLE] = ",".join([*parts, *(f"-{name}" for name in added)])
        return added
    return []


def for_a_child(env_vars: Mapping[str, str] | None) -> dict[str, str]:
    """``env_vars`` (a child process's extra environment, e.g. a Ray actor's
    ``runtime_env["env_vars"]``) with the broken experiments turned off as :func:`turn_off`
    would (the child starts gRPC after it reads them)."""
    env = dict(env_vars or {})
    turn_off(env, grpc_imported=False)
    return env


def state(environ: MutableMapping[str, str] | None = None,
          version: tuple[int, int] | None = None) -> tuple[bool, str]:
    """Whether this process's gRPC runs without the broken experiments, and a sentence for
    the start-up log saying so (``False``: a warning, with what to do)."""
    environ = os.environ if environ is None else environ
    version = grpc_version() if version is None else version
    broken = affecting(version)
    if not broken:
        return True, "gRPC experiments: this grpcio has none of the known broken ones"
    off = {part.strip()[1:] for part in environ.get(VARIABLE, "").split(",")
           if part.strip().startswith("-")}
    missing = [name for name in broken if name not in off]
    if missing:
        assert version is not None
        return False, (
            f"grpcio {version[0]}.{version[1]} runs here with experiment(s) "
            f"{', '.join(missing)} on: a rapid-reset flood on one connection can make gRPC "
            f"cancel other clients' calls (replay_server/grpc_experiments.py); start "
            f"this process with {VARIABLE}={','.join('-' + name for name in missing)} "
            f"(replay-server serve and the Ray shards do)")
    return True, f"gRPC experiments off: {', '.join(broken)} (known to cancel calls)"
