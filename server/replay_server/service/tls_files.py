"""TLS for the server: the certificate, key and client CA files, read and checked.

The files named in ``[server]`` are read once, at start. Each is checked
with Python's ``ssl`` module first (the certificate parses, the key matches
it, the CA bundle holds certificates), and every certificate of the chain
must be valid now (an expired one was accepted, and every client's handshake
then failed), so a wrong file stops the server with a message naming the
setting, the file and the dates instead of gRPC's generic handshake failures
later. The validity dates are read from the DER of each certificate
(:func:`validity`): Python's ``ssl`` has no public way to read them. With ``tls_client_ca_file`` the server asks every
client for a certificate signed by one of those CAs (mutual TLS) and refuses
connections without one.

Without grpc: ``check-config`` checks the files as ``serve`` does
(:mod:`replay_server.service.credentials` makes them the listener's credentials).
"""

from __future__ import annotations

import base64
import datetime
import re
import ssl
import time
from pathlib import Path

from replay_server.errors import ConfigError
from replay_server.service.settings import ServerSettings


def tls_files(settings: ServerSettings) -> tuple[bytes, bytes, bytes | None] | None:
    """The listener's certificate chain, key and client CA bundle (``None``: plaintext, or
    no client CA), each read and checked (see the module); no grpc needed.

    Raises:
        ConfigError: a file cannot be read, is not PEM, the key does not
            belong to the certificate, or a certificate of the chain has expired
            or is not valid yet.
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
    check_valid_now("server.tls_cert_file", settings.tls_cert_file, cert)
    client_ca = None
    if settings.tls_client_ca_file is not None:
        client_ca = _read("server.tls_client_ca_file", settings.tls_client_ca_file)
        try:
            ssl.create_default_context(cafile=settings.tls_client_ca_file)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"server.tls_client_ca_file {settings.tls_client_ca_file!r} holds "
                              f"no PEM CA certificate ({exc})") from None
    return cert, key, client_ca




_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----",
                       re.DOTALL)


def check_valid_now(name: str, path: str, pem: bytes, now: float | None = None) -> None:
    """Raise ConfigError unless every certificate in ``pem`` is valid at ``now`` (default: now).

    Raises:
        ConfigError: a certificate has expired or is not valid yet (naming the file, which
            certificate of the chain and its dates), or cannot be read.
    """
    now = time.time() if now is None else now
    for index, match in enumerate(_PEM_CERT.finditer(pem)):
        which = "the certificate" if index == 0 else f"certificate {index + 1} of the chain"
        try:
            not_before, not_after = validity(base64.b64decode(match.group(1)))
        except ValueError as exc:
            raise ConfigError(f"{name} {path!r}: cannot read {which}'s dates ({exc})") from None
        dates = f"valid from {_utc(not_before)} to {_utc(not_after)}"
        if now > not_after:
            raise ConfigError(f"{name} {path!r}: {which} has expired ({dates}; it is "
                              f"{_utc(now)}): every client would refuse it; renew it")
        if now < not_before:
            raise ConfigError(f"{name} {path!r}: {which} is not valid yet ({dates}; it is "
                              f"{_utc(now)}): check this machine's clock")


def validity(der: bytes) -> tuple[float, float]:
    """``(not_before, not_after)`` of a DER X.509 certificate, as Unix times.

    Certificate = SEQUENCE {tbsCertificate SEQUENCE {[0] version OPTIONAL, serialNumber,
    signature, issuer, validity SEQUENCE {notBefore, notAfter}, ...}, ...}.

    Raises:
        ValueError: not such a certificate.
    """
    _, body, _ = _tlv(der, 0, 0x30)
    _, tbs, _ = _tlv(der, body, 0x30)
    pos = tbs
    if der[pos] == 0xA0:  # [0] EXPLICIT version
        pos = _tlv(der, pos)[2]
    for _ in range(3):  # serialNumber, signature, issuer
        pos = _tlv(der, pos)[2]
    _, inner, _ = _tlv(der, pos, 0x30)
    tag, start, end = _tlv(der, inner)
    not_before = _time(tag, der[start:end])
    tag, start, end = _tlv(der, end)
    return not_before, _time(tag, der[start:end])


def _tlv(der: bytes, pos: int, expect: int | None = None) -> tuple[int, int, int]:
    """``(tag, start of the value, end of the value)`` of the DER element at ``pos``."""
    if pos + 2 > len(der):
        raise ValueError("truncated")
    tag, length = der[pos], der[pos + 1]
    if expect is not None and tag != expect:
        raise ValueError(f"expected tag 0x{expect:02x}, found 0x{tag:02x}")
    start = pos + 2
    if length & 0x80:
        count = length & 0x7F
        if not 1 <= count <= 4 or start + count > len(der):
            raise ValueError("bad length")
        length = int.from_bytes(der[start:start + count], "big")
        start += count
    if start + length > len(der):
        raise ValueError("truncated")
    return tag, start, start + length


def _time(tag: int, value: bytes) -> float:
    text = value.decode("ascii")
    if tag == 0x17:  # UTCTime, YYMMDDHHMMSSZ: years 1950-2049
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != 0x18:  # GeneralizedTime, YYYYMMDDHHMMSSZ
        raise ValueError(f"tag 0x{tag:02x} is not a time")
    when = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ")
    return when.replace(tzinfo=datetime.timezone.utc).timestamp()


def _utc(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def _read(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
