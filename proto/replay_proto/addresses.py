"""Server addresses (``host:port``) as both sides read them."""

from __future__ import annotations

import ipaddress

TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
"""gRPC target URIs passed through as they are (gRPC checks them when it connects)."""


class AddressError(ValueError):
    """An address is not ``host:port`` with a port in 1..65535 (the message says why)."""


def check_address(address: object) -> str:
    """``address`` if a client can dial it, else :class:`AddressError` naming what is wrong.

    Accepted: ``host:port`` (a name, an IPv4 address or a bracketed IPv6 one)
    with a port in 1..65535, or a gRPC target URI (``dns:///host:port``,
    ``unix:/path``, ...), which gRPC itself checks. Refused: an empty
    address, a missing host or port, a port out of range (gRPC would
    silently dial ``port % 65536``), or a host that is an unbracketed IPv6
    address.

    Cost: a few string operations; pure.
    """
    if not isinstance(address, str) or not address.strip():
        raise AddressError(f"a server address must be 'host:port', got {address!r}")
    if address.startswith(TARGET_SCHEMES):
        return address
    host, sep, port = address.rpartition(":")
    shown = address if len(address) <= 80 else address[:80] + "..."
    if not sep or not host or not port:
        raise AddressError(f"server address {shown!r} must be 'host:port' (e.g. "
                           f"'localhost:50051')")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AddressError(f"server address {shown!r}: the port must be a number in 1..65535, "
                           f"got {port[:20]!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise AddressError(f"server address {shown!r}: an IPv6 host is written '[addr]'")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise AddressError(f"server address {shown!r}: {host!r} is not an IPv6 "
                               f"address") from None
    elif ":" in host:
        raise AddressError(f"server address {shown!r}: write an IPv6 host in brackets, "
                           f"'[addr]:port'")
    elif any(c.isspace() for c in host):
        raise AddressError(f"server address {shown!r}: the host contains white space")
    return address


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
