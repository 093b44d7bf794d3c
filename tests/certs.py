"""Certificates made on the fly for the TLS tests (``cryptography``): a CA, and leaves it signs."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class Authority:
    """A certificate authority that signs server and client certificates into ``folder``."""

    def __init__(self, folder: Path, name: str = "test CA") -> None:
        self.folder = folder
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._subject = subject
        self._cert = (
            _builder(subject, subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = folder / f"{_slug(name)}.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def server(self, name: str = "server", valid_days: tuple[float, float] = (-1 / 288, 1)
               ) -> Pem:
        """A server certificate for ``localhost`` and 127.0.0.1, valid from ``valid_days[0]``
        to ``valid_days[1]`` days from now (default: 5 minutes ago to tomorrow)."""
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._leaf(name, names, ExtendedKeyUsageOID.SERVER_AUTH, valid_days)

    def client(self, name: str = "client") -> Pem:
        """A client certificate (mutual TLS)."""
        return self._leaf(name, [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH)

    def _leaf(self, name: str, names: list, usage: x509.ObjectIdentifier,
              valid_days: tuple[float, float] = (-1 / 288, 1)) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, self._subject, key.public_key(), valid_days)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        stem = self.folder / f"{_slug(self.name)}-{_slug(name)}"
        pem = Pem(stem.with_suffix(".crt"), stem.with_suffix(".key"))
        pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        return pem


def _builder(subject: x509.Name, issuer: x509.Name, public_key,
             valid_days: tuple[float, float] = (-1 / 288, 1)) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=valid_days[0]))
            .not_valid_after(now + datetime.timedelta(days=valid_days[1])))


def _slug(name: str) -> str:
    return name.replace(" ", "-")
