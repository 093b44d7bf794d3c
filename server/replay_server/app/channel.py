"""The operator's channel to a server: the address, TLS and token flags of the operator's
commands (:mod:`replay_server.app.commands`), and the gRPC channel they make.

The token (from ``--token-env``, ``REPLAY_TOKEN`` by default) is sent over
TLS, or over plaintext to a loopback address; to another host in clear text
only with ``--allow-plaintext-token``. The same rule as the client library's.

grpc is imported by :func:`open_channel` only, so that building the command
line (``--help``, ``--version``) loads nothing but argparse.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from replay_proto.addresses import DEFAULT_ADDRESS, token_may_travel
from replay_proto.call_metadata import request_bytes_metadata
from replay_server.errors import ConfigError

if TYPE_CHECKING:
    import grpc


def add_channel_flags(parser: argparse.ArgumentParser) -> None:
    """``--address``, the TLS flags, ``--token-env`` and ``--allow-plaintext-token``."""
    parser.add_argument("--address", default=DEFAULT_ADDRESS, metavar="HOST:PORT",
                        help=f"the server (default {DEFAULT_ADDRESS}; port 50051 when omitted)")
    parser.add_argument("--tls-ca", metavar="FILE",
                        help="connect with TLS, trusting this PEM CA bundle for the server")
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS, trusting the system's CAs")
    parser.add_argument("--tls-cert", metavar="FILE",
                        help="client certificate (PEM) for mutual TLS, with --tls-key")
    parser.add_argument("--tls-key", metavar="FILE", help="client private key (PEM)")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="name to check the server's certificate against (default: the "
                             "address's host)")
    parser.add_argument("--token-env", default="REPLAY_TOKEN",
                        help="environment variable holding the auth token, if any "
                             "(default REPLAY_TOKEN)")
    parser.add_argument("--allow-plaintext-token", action="store_true",
                        help="send the token without TLS to a non-loopback address")


def uses_tls(args: argparse.Namespace) -> bool:
    return bool(args.tls or args.tls_ca or args.tls_cert or args.tls_key)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to ``args.address``, with TLS when any TLS flag is given.

    Raises:
        ConfigError: a TLS file cannot be read, or only one of cert and key was given.
    """
    import grpc

    if not uses_tls(args):
        return grpc.insecure_channel(args.address)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together (mutual TLS needs both)")
    credentials = grpc.ssl_channel_credentials(
        _read("--tls-ca", args.tls_ca), _read("--tls-key", args.tls_key),
        _read("--tls-cert", args.tls_cert))
    options = [] if args.tls_server_name is None else [
        ("grpc.ssl_target_name_override", args.tls_server_name)]
    return grpc.secure_channel(args.address, credentials, options=options)


def call_metadata(args: argparse.Namespace, request_bytes: int = 0
                  ) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` header when a token is set, and the request's size.

    The request's size (``replay_proto.call_metadata``) is what the server
    reserves to read it: nothing for the empty Info and Checkpoint requests.

    Raises:
        ConfigError: the token would cross a network in clear text.
    """
    empty = request_bytes_metadata(request_bytes)
    token = os.environ.get(args.token_env) if args.token_env else None
    if not token:
        return empty
    if not token_may_travel(args.address, tls=uses_tls(args),
                            plaintext_allowed=args.allow_plaintext_token):
        raise ConfigError(
            f"refusing to send the token in ${args.token_env} to {args.address} without TLS, "
            f"where it can be read on the network: pass --tls-ca FILE (or --tls), or "
            f"--allow-plaintext-token on a trusted network")
    return (("authorization", f"Bearer {token}"),) + empty


def _read(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: {exc.strerror}") from None
