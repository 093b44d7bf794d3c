"""TLS for the server: the checked files (:mod:`replay_server.service.tls_files`) as the
listener's gRPC credentials."""

from __future__ import annotations

import grpc

from replay_server.service.settings import ServerSettings
from replay_server.service.tls_files import tls_files


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """The listener's TLS credentials (``None``: plaintext).

    Raises:
        ConfigError: as :func:`~replay_server.service.tls_files.tls_files` does.
    """
    files = tls_files(settings)
    if files is None:
        return None
    cert, key, client_ca = files
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None)
