"""``TlsConfig``: how a client checks the server's certificate and, for mutual TLS, proves its own.

::

    tls = TlsConfig.from_files(ca="ca.crt")                                # TLS
    tls = TlsConfig.from_files(ca="ca.crt", cert="me.crt", key="me.key")   # mutual TLS
    client = ReplayClient("replay.internal:50051", tls=tls, token=...)

``ReplayClient(address, tls=True)`` trusts the system's certificate
authorities (gRPC's default roots). A token is only sent over a plaintext
channel to a loopback address, unless the caller passes
``allow_plaintext_token=True`` (see :func:`check_token_channel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from replay_client.errors import InvalidArgumentError
from replay_proto.addresses import token_may_travel


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings of a client's channel (PEM bytes, as gRPC takes them).

    Attributes:
        root_certificates: CA certificates the server's certificate must chain
            to; ``None``: the system's roots.
        certificate_chain: the client's certificate (mutual TLS), with ``private_key``.
        private_key: the client's private key.
        server_name: the name to check the server's certificate against, when
            the address is not it (an IP, a tunnel); ``None``: the address's host.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("root_certificates", "certificate_chain", "private_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bytes):
                raise InvalidArgumentError(
                    f"TlsConfig.{name} must be PEM bytes (use TlsConfig.from_files for paths), "
                    f"got {type(value).__name__}")
        if (self.certificate_chain is None) != (self.private_key is None):
            raise InvalidArgumentError(
                "TlsConfig: certificate_chain and private_key go together (mutual TLS needs "
                "both the client's certificate and its key)")

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None,
                   key: str | Path | None = None, server_name: str | None = None) -> TlsConfig:
        """Read the PEM files (``ca``: the server's CA; ``cert``/``key``: for mutual TLS).

        Raises:
            InvalidArgumentError: a file cannot be read.
        """
        return cls(root_certificates=_read("ca", ca), certificate_chain=_read("cert", cert),
                   private_key=_read("key", key), server_name=server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                            self.certificate_chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [] if self.server_name is None else [
            ("grpc.ssl_target_name_override", self.server_name)]


def check_token_channel(address: str, token: str | None, tls: TlsConfig | None,
                        allow_plaintext_token: bool) -> None:
    """Refuse to send ``token`` where it could be read on the network.

    A token goes over TLS, or over plaintext to a loopback address (the
    bytes never leave the host), or anywhere when ``allow_plaintext_token``.

    Raises:
        InvalidArgumentError: a token would cross a network in clear text.
    """
    if token and not token_may_travel(address, tls=tls is not None,
                                      plaintext_allowed=allow_plaintext_token):
        raise InvalidArgumentError(
            f"refusing to send the auth token to {address} over a plaintext channel, where it "
            f"can be read on the network: pass tls=TlsConfig.from_files(ca=...) (or tls=True), "
            f"or allow_plaintext_token=True on a trusted network")


def _read(name: str, path: str | Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"TLS {name} file {str(path)!r}: {exc.strerror}") from None
