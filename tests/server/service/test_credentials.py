"""credentials: the validity dates read from a certificate's DER match what made it."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from replay_server.errors import ConfigError
from replay_server.service.tls_files import check_valid_now, validity

UTC = datetime.timezone.utc


def certificate(not_before: datetime.datetime, not_after: datetime.datetime) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(7).not_valid_before(not_before)
            .not_valid_after(not_after).sign(key, hashes.SHA256()))


@pytest.mark.parametrize("after_year", [2030, 2060])  # UTCTime, then GeneralizedTime (>= 2050)
def test_validity_reads_both_time_encodings(after_year: int) -> None:
    before = datetime.datetime(2020, 1, 2, 3, 4, 5, tzinfo=UTC)
    after = datetime.datetime(after_year, 6, 7, 8, 9, 10, tzinfo=UTC)
    cert = certificate(before, after)
    assert validity(cert.public_bytes(serialization.Encoding.DER)) == (
        before.timestamp(), after.timestamp())


def test_every_certificate_of_a_chain_is_checked() -> None:
    now = datetime.datetime.now(UTC)
    good = certificate(now - datetime.timedelta(days=1), now + datetime.timedelta(days=1))
    old = certificate(now - datetime.timedelta(days=9), now - datetime.timedelta(days=2))
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in (good, old))
    with pytest.raises(ConfigError, match="certificate 2 of the chain has expired"):
        check_valid_now("server.tls_cert_file", "chain.pem", pem)
    check_valid_now("server.tls_cert_file", "good.pem", good.public_bytes(serialization.Encoding.PEM))


def test_garbage_is_refused_not_crashed_on() -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    with pytest.raises(ConfigError, match="cannot read the certificate's dates"):
        check_valid_now("server.tls_cert_file", "x.pem", pem)
