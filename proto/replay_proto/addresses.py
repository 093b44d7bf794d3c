"""Server addresses (``host:port``) as both sides read them."""

from __future__ import annotations

import ipaddress

DEFAULT_PORT = 50051
"""The port a server listens on, and operators' commands call, unless told otherwise."""

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
"""Where a server listens by default: this host only."""


class AddressError(ValueError):
    """An address that is not ``host[:port]``; the message says what was wrong."""


def with_port(address: str, port: int = DEFAULT_PORT) -> str:
    """``address`` with ``port`` added where it names none (``localhost`` ->
    ``localhost:50051``, ``::1`` -> ``[::1]:50051``), so that gRPC never picks
    its own default (443). A gRPC target with a scheme (``dns:///...``,
    ``unix:...``) is returned as it is.

    Raises:
        AddressError: empty, or a port that is not a number from 0 to 65535.
    """
    text = address.strip()
    if not text:
        raise AddressError("the address is empty; expected HOST:PORT, e.g. "
                           f"{DEFAULT_ADDRESS}")
    if ":/" in text or text.startswith("unix:"):
        return text
    if text.startswith("["):
        host, bracket, rest = text.partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise AddressError(f"address {address!r}: expected [IPv6]:PORT, e.g. [::1]:{port}")
        host, given = host + "]", rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 address
        host, given = f"[{text}]", None
    else:
        host, _, given = text.partition(":")
        given = given if ":" in text else None
    if given is None:
        return f"{host}:{port}"
    if not given.isdigit() or int(given) > 65535:
        raise AddressError(f"address {address!r}: the port {given!r} is not a number from 0 "
                           f"to 65535")
    return f"{host}:{given}"


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
