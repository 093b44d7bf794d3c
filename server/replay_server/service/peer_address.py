"""The connection a gRPC peer string names: ``(ip, port)``, as a socket's ``getpeername`` gives
it (IPv4 mapped into IPv6 written as plain IPv4), so that what a call's context says and what
a socket says compare equal. Thread-safety: pure functions (the cache is thread-safe)."""

from __future__ import annotations

import functools
import ipaddress

PEERS_CACHED = 4096
"""Peer strings whose address is kept (one per connection; every call names its peer, and
parsing an address cost 2-4% of the loop's time per small insert)."""


@functools.lru_cache(maxsize=PEERS_CACHED)
def peer_address(peer: str) -> tuple[str, int] | None:
    """``(ip, port)`` of a gRPC peer string (``ipv4:10.0.0.7:53412``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    return normal(host.strip("[]")), int(port)


def normal(host: str) -> str:
    """An IPv4 address mapped into IPv6 (``::ffff:1.2.3.4``) as plain IPv4."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)
