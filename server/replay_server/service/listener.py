"""Binding the server's listeners, with a port in use named as such (never gRPC's raw line).

gRPC prints its own raw ``add_port`` line on a failed bind before raising; so the
address is probed first (bound with ``SO_REUSEADDR`` as gRPC binds), and a bind
that fails anyway is told apart by probing again. Called on the event loop at
start; the probe costs one socket.
"""

from __future__ import annotations

import errno
import socket

import grpc

from replay_server.errors import ConfigError


def listen(server: grpc.aio.Server, address: str,
           credentials: grpc.ServerCredentials | None, prefix: str = "") -> int:
    """Bind ``address`` (with TLS when ``credentials``); returns the port.

    Raises:
        ConfigError: the address cannot be bound.
    """
    in_use = ConfigError(
        f"{prefix}cannot listen on {address}: the port is in use (another replay-server?); "
        f"stop what holds it, or choose another port (port 0: any free one)")
    if _in_use(address):  # asked first: gRPC would print its own raw line before failing
        raise in_use
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        if _in_use(address):
            raise in_use from None
        raise ConfigError(f"{prefix}cannot listen on {address}: {exc}") from None


def _in_use(address: str) -> bool:
    """Whether binding ``host:port`` fails because something else listens on the port (bound
    with ``SO_REUSEADDR``, as gRPC binds, so a restarted server's old connections in
    TIME_WAIT do not count). Port 0 never is."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if int(port) == 0:
            return False
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, int(port)))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    except ValueError:
        return False
    return False
