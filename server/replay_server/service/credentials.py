"""TLS for the server: the certificate, key and client CA files, checked, as credentials.

The files named in ``[server]`` are read once, at start. Each is checked
with Python's ``ssl`` module first (the certificate parses, the key matches
it, the CA bundle holds certificates), so a wrong file stops the server with
a message naming the setting and the file instead of gRPC's generic
handshake failures later. With ``tls_client_ca_file`` the server asks every
client for a certificate signed by one of those CAs (mutual TLS) and refuses
connections without one.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from replay_server.errors import ConfigError
from replay_server.service.settings import ServerSettings


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """The listener's TLS credentials (``None``: plaintext).

    Raises:
        ConfigError: a file cannot be read, is not PEM, or the key does not
            belong to the certificate.
    """
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    cert = _read("server.tls_cert_file", settings.tls_cert_file)
    key = _read("server.tls_key_file", settings.tls_key_file)
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            settings.tls_cert_file, settings.tls_key_file)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"server.tls_cert_file {settings.tls_cert_file!r} and server.tls_key_file "
            f"{settings.tls_key_file!r} are not a PEM certificate chain and its private key "
            f"({exc})") from None
    client_ca = None
    if settings.tls_client_ca_file is not None:
        client_ca = _read("server.tls_client_ca_file", settings.tls_client_ca_file)
        try:
            ssl.create_default_context(cafile=settings.tls_client_ca_file)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"server.tls_client_ca_file {settings.tls_client_ca_file!r} holds "
                              f"no PEM CA certificate ({exc})") from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None)


def _read(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
