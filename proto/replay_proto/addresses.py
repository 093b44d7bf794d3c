"""Server addresses (``host:port``) as both sides read them."""

from __future__ import annotations

import ipaddress

DEFAULT_PORT = 50051
"""The port a server listens on, and operators' commands call, unless told otherwise."""

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
"""Where a server listens by default: this host only."""

TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
"""gRPC target URIs passed through as they are (gRPC checks them when it connects)."""

_SHOWN_CHARS = 80
"""Longest part of an address an error message repeats (an address may be megabytes)."""


class AddressError(ValueError):
    """An address that is not ``host[:port]``; the message says what was wrong."""


def with_port(address: object, port: int = DEFAULT_PORT) -> str:
    """``address`` with ``port`` added where it names none (``localhost`` ->
    ``localhost:50051``, ``::1`` -> ``[::1]:50051``), so that gRPC never picks
    its own default (443). A gRPC target with a scheme (``dns:///...``,
    ``unix:...``) is returned as it is (gRPC checks it when it connects).
    Port 0 (a listener's "any free port") passes; :func:`check_address` refuses
    it for a client.

    Cost: a few string operations; pure.

    Raises:
        AddressError: empty or no string, no host, a host with white space or an
            IPv6 address that is none, or a port that is not a number from 0 to
            65535 (gRPC would dial ``port % 65536``).
    """
    if not isinstance(address, str) or not address.strip():
        raise AddressError(f"the address is empty; expected HOST:PORT, e.g. {DEFAULT_ADDRESS}"
                           if isinstance(address, str) or address is None else
                           f"an address is a string HOST:PORT, got {type(address).__name__}")
    text = address.strip()
    shown = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
    if ":/" in text or text.startswith(TARGET_SCHEMES):
        return text
    if text.startswith("["):
        host, bracket, rest = text.partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise AddressError(f"address {shown!r}: expected [IPv6]:PORT, e.g. [::1]:{port}")
        _check_ipv6(host[1:], shown)
        host, given = host + "]", rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 address
        _check_ipv6(text, shown)
        host, given = f"[{text}]", None
    else:
        host, _, given = text.partition(":")
        given = given if ":" in text else None
        if not host:
            raise AddressError(f"address {shown!r} names no host; expected HOST:PORT, e.g. "
                               f"{DEFAULT_ADDRESS}")
        if any(c.isspace() for c in host):
            raise AddressError(f"address {shown!r}: the host contains white space")
    if given is None:
        return f"{host}:{port}"
    if not given.isdigit() or len(given) > 5 or int(given) > 65535:
        raise AddressError(f"address {shown!r}: the port {given[:20]!r} is not a number from "
                           f"0 to 65535")
    return f"{host}:{given}"


def check_address(address: object) -> str:
    """The address a client dials for ``address`` (:func:`with_port`), port 0 refused.

    Raises:
        AddressError: as :func:`with_port`, or port 0 (no server listens there).
    """
    dialed = with_port(address)
    if ":/" in dialed or dialed.startswith(TARGET_SCHEMES):
        return dialed
    if int(dialed.rpartition(":")[2]) == 0:
        raise AddressError(f"address {dialed[:_SHOWN_CHARS]!r}: port 0 names no server; "
                           f"give the port the server listens on (1 to 65535)")
    return dialed


def _check_ipv6(host: str, shown: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise AddressError(f"address {shown!r}: {host[:_SHOWN_CHARS]!r} is no IPv6 address "
                           f"(an IPv6 host is written in brackets, [::1]:PORT)") from None


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


def token_may_travel(address: str, *, tls: bool, plaintext_allowed: bool) -> bool:
    """The token rule both sides apply: an auth token goes over TLS, over plaintext to a
    loopback address (the bytes never leave the host), or anywhere when the user allowed
    plaintext (``allow_plaintext_token``, ``--allow-plaintext-token``)."""
    return tls or plaintext_allowed or is_loopback(address)
