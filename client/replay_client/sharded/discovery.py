"""Where a sharded client's servers are: a list of addresses, or a name resolving to all of them.

* ``["host-0:50051", "host-1:50051", ...]``: those servers, one shard each.
* ``"shards://NAME:PORT"``: every address ``NAME`` resolves to, at ``PORT``
  (a Kubernetes headless Service resolves to one address per ready pod of its
  StatefulSet: ``docs/scale-out.md``). Resolved when the client first
  connects, then again on an interval and after a shard was found
  unavailable (:mod:`replay_client.sharded.shard_set`).

Which shard a server is comes from the server itself (its ``shard`` in
``info``), never from the order of addresses.

The resolver is injectable: ``resolver(host, port) -> ["ip:port", ...]``
(tests use one they control; the default asks the system's resolver, which
for a headless Service is the cluster's DNS).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from replay_client.errors import (
    InvalidArgumentError,
    ReplayError,
    ShardingError,
    UnavailableError,
)

SCHEME = "shards://"
"""Prefix of a name whose every address is one shard."""

MAX_SHARDS = 128
"""Shard indices are 7 bits of every id (bits 56..62)."""

Resolver = Callable[[str, int], Sequence[str]]
"""``resolver(host, port)``: the ``host:port`` addresses ``host`` stands for."""


def is_sharded(address: Any) -> bool:
    """Whether ``address`` names many servers (a list, or a ``shards://`` name)."""
    return isinstance(address, (list, tuple)) or (
        isinstance(address, str) and address.startswith(SCHEME))


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives ``host`` (sorted, each once), at ``port``."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UnavailableError(f"cannot resolve {host!r} to shard addresses: {exc}") from None
    hosts = sorted({info[4][0] for info in found})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


def addresses_of(spec: Any, resolver: Resolver | None = None) -> list[str]:
    """The shard addresses ``spec`` names (see the module docstring).

    Raises:
        InvalidArgumentError: an empty list, an item that is not ``host:port``,
            or a ``shards://`` name without a port.
        ShardingError: an address given twice, or more than 128 addresses.
        UnavailableError: the name does not resolve (or resolves to nothing).
    """
    if isinstance(spec, str):
        host, _, port_text = spec[len(SCHEME):].rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise InvalidArgumentError(f"{spec!r} must be 'shards://NAME:PORT' (a port in 1..65535)")
        port = int(port_text)
        addresses = list((resolver or system_resolver)(host, port))
        if not addresses:
            raise UnavailableError(f"{spec!r} resolves to no address (no shard is ready?)")
    else:
        addresses = list(spec)
        if not addresses:
            raise InvalidArgumentError("a sharded client needs at least one address, got []")
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
    return addresses


def named(exc: ReplayError, where: str) -> ReplayError:
    """``exc``'s kind, its message prefixed by ``where`` (the shard or server it came from)."""
    try:
        return type(exc)(f"{where}: {exc}")
    except TypeError:
        return exc
