"""Where a sharded client's servers are: a list of addresses, or a name resolving to all of them.

* ``["host-0:50051", "host-1:50051", ...]``: those servers, one shard each.
* ``"shards://NAME:PORT"``: every address ``NAME`` resolves to, at ``PORT``
  (a Kubernetes headless Service resolves to one address per ready pod of its
  StatefulSet: ``docs/scale-out.md``). Resolved when the client first
  connects, then again on an interval and after a shard was found
  unavailable (:mod:`replay_client.sharded.shard_set`).
  ``"shards://NAME:PORT?expected=3"`` also says how many shards the replay
  has (the StatefulSet's replicas, shards ``0..2``): a shard the name does
  not give is known to be missing (see :class:`Resolution`).
* ``"ray://NAMESPACE/NAME"``: the shards of a replay started on Ray
  (``replay_server.ray``, ``docs/ray.md``), as its registry actor lists them:
  every expected shard with its state (:mod:`replay_client.sharded.ray_registry`,
  imported only for such a name: the client works without Ray installed).

Which shard a server is comes from the server itself (its ``shard`` in
``info``), never from the order of addresses.

The resolver is injectable: for ``shards://``, ``resolver(host, port)``; for
``ray://``, ``resolver(namespace, name)``. Either returns the addresses
(``["ip:port", ...]``) or a :class:`Resolution` (tests use ones they control;
the defaults ask the system's resolver, which for a headless Service is the
cluster's DNS, and the replay's Ray registry).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs

from replay_client.errors import (
    InvalidArgumentError,
    ReplayError,
    ShardingError,
    UnavailableError,
)
from replay_client.sharded.resolution import Resolution, ShardState
from replay_proto.id_layout import MAX_SHARDS

__all__ = ["RAY_SCHEME", "SCHEME", "Resolution", "Resolver", "ShardState", "addresses_of",
           "is_sharded", "named", "resolve", "system_resolver"]

SCHEME = "shards://"
"""Prefix of a name whose every address is one shard."""

RAY_SCHEME = "ray://"
"""Prefix of a replay started on Ray, found through its registry actor."""

Resolver = Callable[[str, Any], "Sequence[str] | Resolution"]
"""``resolver(host, port)`` (``shards://``) or ``resolver(namespace, name)`` (``ray://``):
the ``host:port`` addresses the name stands for, or a :class:`Resolution`."""


def is_sharded(address: Any) -> bool:
    """Whether ``address`` names many servers (a list, a ``shards://`` or ``ray://`` name)."""
    return isinstance(address, (list, tuple)) or (
        isinstance(address, str) and address.startswith((SCHEME, RAY_SCHEME)))


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives ``host`` (sorted, each once), at ``port``."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UnavailableError(f"cannot resolve {host!r} to shard addresses: {exc}") from None
    hosts = sorted({str(info[4][0]) for info in found})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


def _expected_of(spec: str, query: str) -> int | None:
    """``expected=N`` of a name's query (``None`` without one)."""
    options = parse_qs(query, keep_blank_values=True)
    unknown = set(options) - {"expected"}
    if unknown:
        raise InvalidArgumentError(f"{spec!r}: unknown option(s) {sorted(unknown)}; the only "
                                   f"one is expected=N (how many shards the replay has)")
    if "expected" not in options:
        return None
    text = options["expected"][-1]
    if not text.isdigit() or not 1 <= int(text) <= MAX_SHARDS:
        raise InvalidArgumentError(f"{spec!r}: expected must be a whole number of shards in "
                                   f"1..{MAX_SHARDS}, got {text!r}")
    return int(text)


def resolve(spec: Any, resolver: Resolver | None = None) -> Resolution:
    """What ``spec`` names now (see the module docstring).

    Raises:
        InvalidArgumentError: an empty list, an item that is not ``host:port``,
            a ``shards://`` name without a port or with a bad ``expected``, or a
            ``ray://`` name that is not ``ray://NAMESPACE/NAME``.
        ShardingError: an address given twice, or more than 128 addresses.
        UnavailableError: the name does not resolve (or, without an expected
            count, resolves to nothing).
    """
    if isinstance(spec, str) and spec.startswith(RAY_SCHEME):
        namespace, _, name = spec[len(RAY_SCHEME):].partition("/")
        if not namespace or not name or "/" in name:
            raise InvalidArgumentError(f"{spec!r} must be 'ray://NAMESPACE/NAME' (a replay "
                                       f"started with replay_server.ray.ReplayCluster)")
        if resolver is None:
            from replay_client.sharded.ray_registry import registry_resolver
            resolver = registry_resolver
        found = resolver(namespace, name)
        resolution = found if isinstance(found, Resolution) else Resolution(tuple(found))
    elif isinstance(spec, str):
        name, _, query = spec[len(SCHEME):].partition("?")
        host, _, port_text = name.rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise InvalidArgumentError(f"{spec!r} must be 'shards://NAME:PORT' (a port in "
                                       f"1..65535, optionally ?expected=N)")
        expected = _expected_of(spec, query)
        found = (resolver or system_resolver)(host, int(port_text))
        resolution = found if isinstance(found, Resolution) else Resolution(
            tuple(found), expected)
        if expected is not None and resolution.expected is None:
            resolution = Resolution(resolution.addresses, expected, resolution.shards)
    else:
        resolution = Resolution(tuple(spec))
        if not resolution.addresses:
            raise InvalidArgumentError("a sharded client needs at least one address, got []")
    if not resolution.addresses and resolution.expected is None:
        raise UnavailableError(f"{spec!r} resolves to no address (no shard is ready?)")
    _check(list(resolution.addresses))
    return resolution


def addresses_of(spec: Any, resolver: Resolver | None = None) -> list[str]:
    """The shard addresses ``spec`` names now (:func:`resolve`'s ``addresses``)."""
    return list(resolve(spec, resolver).addresses)


def _check(addresses: list[str]) -> None:
    for address in addresses:
        if not isinstance(address, str) or ":" not in address:
            raise InvalidArgumentError(f"shard addresses must be 'host:port' strings, "
                                       f"got {address!r} in {addresses!r}")
    if len(set(addresses)) != len(addresses):
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        raise ShardingError(f"shard address(es) {twice} given more than once")
    if len(addresses) > MAX_SHARDS:
        raise ShardingError(f"{len(addresses)} shard addresses; at most {MAX_SHARDS} shards exist "
                            f"(ids carry the shard in 7 bits)")


def named(exc: ReplayError, where: str) -> ReplayError:
    """``exc``'s kind, its message prefixed by ``where`` (the shard or server it came from)."""
    try:
        return type(exc)(f"{where}: {exc}")
    except TypeError:
        return exc
