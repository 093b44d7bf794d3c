"""Server addresses (``host:port``) as both sides read them."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` names this host only (127.0.0.0/8, ``[::1]``, ``localhost``).

    Traffic to such an address never leaves the host, which is why a token may
    travel there without TLS (``docs/operations.md``, "TLS and tokens").
    """
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
