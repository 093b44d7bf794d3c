"""TLS, mutual TLS and tokens against real servers, with certificates made on the fly.

A client that does not trust the server's CA is refused; one that does can
make every call; with mutual TLS a client without a certificate from the
client CA is refused; a token never travels in clear text to another host
unless allowed; health still answers (over TLS, and on the plaintext
``health_address`` for probes that cannot speak TLS).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from replay_client import ReplayClient, TlsConfig, errors
from tests.certs import Authority
from tests.conftest import ServerProcess, start_server

TOKEN = "tls-s3cret"
TABLES = ('[[tables]]\nname = "replay"\ncapacity = 100\nsampler = "prioritized"\n'
          '[[tables]]\nname = "slice"\ncapacity = 100\nsampler = "slice"\nslice_len = 4\n')


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = Authority(folder, "test CA"), Authority(folder, "other CA")
    return {"folder": folder, "ca": ca, "server": ca.server(), "client": ca.client(),
            "other": other, "stranger": other.client("stranger")}


def _tls_config(pki: dict, *, mutual: bool, health_port: int) -> str:
    server = pki["server"]
    lines = [f'tls_cert_file = "{server.cert}"', f'tls_key_file = "{server.key}"',
             f'health_address = "127.0.0.1:{health_port}"', 'auth_token_env = "TLS_TEST_TOKEN"',
             f'checkpoint_dir = "{pki["folder"] / ("mtls" if mutual else "tls")}"',
             "checkpoint_interval_s = 0"]
    if mutual:
        lines.append(f'tls_client_ca_file = "{pki["ca"].cert}"')
    return "[server]\n" + "\n".join(lines) + "\n" + TABLES


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(pki: dict, tmp_path_factory, *, mutual: bool) -> tuple[ServerProcess, int]:
    health_port = _free_port()
    folder = tmp_path_factory.mktemp("mtls" if mutual else "tls")
    return start_server(folder, _tls_config(pki, mutual=mutual, health_port=health_port),
                        env={"TLS_TEST_TOKEN": TOKEN}), health_port


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory) -> Iterator[tuple[ServerProcess, int]]:
    proc, port = _start(pki, tmp_path_factory, mutual=False)
    yield proc, port
    proc.stop()


@pytest.fixture(scope="module")
def mtls_server(pki, tmp_path_factory) -> Iterator[tuple[ServerProcess, int]]:
    proc, port = _start(pki, tmp_path_factory, mutual=True)
    yield proc, port
    proc.stop()


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``replay-server ARGS`` as a process (``serve``)."""
    return subprocess.run([sys.executable, "-m", "replay_server.app.cli", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, check=False)


@pytest.fixture
def command(capsys, monkeypatch):
    """Run an operator's command (``replay-server health|info ...``) in this process."""
    from replay_server.app.cli import main

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def _refused(client: ReplayClient, match: str | None = None) -> None:
    """The client cannot reach the server; ``match``: the error says what to set."""
    with pytest.raises(errors.UnavailableError, match=match):
        client.info()


# ---------------------------------------------------------------------- TLS


def test_the_server_says_it_listens_with_tls(tls_server, mtls_server) -> None:
    assert "tls: on" in tls_server[0].log()
    assert "tls: mutual (client certificates required)" in mtls_server[0].log()


def test_a_client_that_does_not_trust_the_servers_ca_is_refused(tls_server, pki) -> None:
    address = tls_server[0].address
    options = {"token": TOKEN, "timeout": 10, "max_retry_s": 0}
    handshake = "the TLS handshake with .* failed .*TlsConfig.from_files\\(ca=...\\)"
    _refused(ReplayClient(address, tls=True, **options), handshake)        # system roots
    _refused(ReplayClient(address, tls=TlsConfig.from_files(ca=pki["other"].cert), **options),
             handshake)
    # Plaintext to a TLS server: not "no replay server at ... (is it running?)".
    _refused(ReplayClient(address, **options),
             "closes this client's plaintext connections: if the server uses TLS")


def test_with_the_ca_every_call_works(tls_server, pki) -> None:
    tls = TlsConfig.from_files(ca=pki["ca"].cert)
    client = ReplayClient(tls_server[0].address, tls=tls, token=TOKEN, timeout=30)
    ids = client.insert("replay", {"obs": torch.arange(20.0).reshape(10, 2)})
    first = int(ids[0])
    assert ids.tolist() == list(range(first, first + 10))  # consecutive
    batch = client.sample("replay", 4)
    assert batch.data["obs"].shape == (4, 2)
    assert client.update_priorities("replay", batch.ids, torch.ones(4)) == 4
    client.update_priorities("replay", batch.ids, torch.full((4,), 2.0), wait=False)
    client.flush_updates()
    for shared_memory in (False, True):
        with client.stream("replay", 3, prefetch=2, shared_memory=shared_memory) as stream:
            assert next(stream).data["obs"].shape == (3, 2)
            assert stream.transport == ("shared_memory" if shared_memory else "grpc")
    with client.writer("slice") as writer:
        for step in range(8):
            writer.append({"obs": torch.full((2,), float(step)), "done": step == 7})
    assert client.sample("slice", 2).data["obs"].shape == (2, 4, 2)
    info = client.info()
    assert (info["replay"].size, info["slice"].size) == (10, 8)
    assert Path(client.checkpoint()).is_dir()
    client.reset("replay")
    assert client.info()["replay"].size == 0


def test_the_token_is_still_checked_over_tls(tls_server, pki, monkeypatch) -> None:
    tls = TlsConfig.from_files(ca=pki["ca"].cert)
    with pytest.raises(errors.UnauthenticatedError, match="the token this client sent is not "
                                                          "the server's: compare REPLAY_TOKEN"):
        ReplayClient(tls_server[0].address, tls=tls, token="wrong", timeout=10).info()
    monkeypatch.delenv("REPLAY_TOKEN", raising=False)
    with pytest.raises(errors.UnauthenticatedError, match="sent no token: set REPLAY_TOKEN"):
        ReplayClient(tls_server[0].address, tls=tls, timeout=10).info()


def test_the_cli_speaks_tls_and_health_needs_no_token(tls_server, pki, command) -> None:
    proc, health_port = tls_server
    ca = str(pki["ca"].cert)
    health = command("health", "--address", proc.address, "--tls-ca", ca)
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stdout + health.stderr
    assert command("health", "--address", proc.address).returncode == 1  # plaintext: no answer
    info = command("info", "--address", proc.address, "--tls-ca", ca, "--json",
                env={"REPLAY_TOKEN": TOKEN})
    assert info.returncode == 0, info.stderr
    assert '"tls": true' in info.stdout and '"auth": true' in info.stdout
    plain_health = command("health", "--address", f"127.0.0.1:{health_port}")
    assert plain_health.returncode == 0 and "SERVING" in plain_health.stdout


def test_the_plaintext_health_address_serves_health_only(tls_server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{tls_server[1]}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/replay.v1.ReplayService/Info")(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


# --------------------------------------------------------------- mutual TLS


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_server, pki,
                                                          command) -> None:
    address = mtls_server[0].address
    options = {"token": TOKEN, "timeout": 10, "max_retry_s": 0}
    _refused(ReplayClient(address, tls=TlsConfig.from_files(ca=pki["ca"].cert), **options),
             "if it requires client certificates \\(mutual TLS")
    stranger = TlsConfig.from_files(ca=pki["ca"].cert, cert=pki["stranger"].cert,
                                    key=pki["stranger"].key)
    _refused(ReplayClient(address, tls=stranger, **options))  # signed by another CA
    no_cert = command("health", "--address", address, "--tls-ca", str(pki["ca"].cert))
    assert no_cert.returncode == 1


def test_mutual_tls_with_a_client_certificate_works(mtls_server, pki, command) -> None:
    proc, health_port = mtls_server
    client_pem = pki["client"]
    tls = TlsConfig.from_files(ca=pki["ca"].cert, cert=client_pem.cert, key=client_pem.key)
    client = ReplayClient(proc.address, tls=tls, token=TOKEN, timeout=30)
    client.insert("replay", {"obs": torch.zeros(5, 2)})
    assert client.sample("replay", 2).data["obs"].shape == (2, 2)
    assert client.info()["replay"].size == 5
    health = command("health", "--address", proc.address, "--tls-ca", str(pki["ca"].cert),
                  "--tls-cert", str(client_pem.cert), "--tls-key", str(client_pem.key))
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stdout + health.stderr
    assert command("health", "--address", f"127.0.0.1:{health_port}").returncode == 0


# ------------------------------------------------------------------- tokens


def test_the_client_refuses_to_send_a_token_in_clear_to_another_host(pki) -> None:
    remote = "10.11.12.13:50051"  # never contacted: refused at construction
    with pytest.raises(errors.InvalidArgumentError, match="plaintext channel"):
        ReplayClient(remote, token="t")
    ReplayClient(remote, token="t", allow_plaintext_token=True)
    ReplayClient(remote, token="t", tls=TlsConfig.from_files(ca=pki["ca"].cert))
    ReplayClient(remote)                                # no token: nothing to protect
    for local in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051"):
        ReplayClient(local, token="t")                  # the bytes never leave the host


def test_the_cli_refuses_to_send_a_token_in_clear_to_another_host(command) -> None:
    result = command("info", "--address", "10.11.12.13:50051", env={"REPLAY_TOKEN": "t"})
    assert result.returncode == 2
    assert "refusing to send the token in $REPLAY_TOKEN to 10.11.12.13:50051" in result.stderr


def test_tls_settings_of_the_client_are_checked(pki, tmp_path) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="go together"):
        TlsConfig(root_certificates=b"x", certificate_chain=b"y")
    with pytest.raises(errors.InvalidArgumentError, match="missing.crt"):
        TlsConfig.from_files(ca=tmp_path / "missing.crt")
    with pytest.raises(errors.InvalidArgumentError, match="PEM bytes"):
        TlsConfig(root_certificates="not bytes")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="tls must be"):
        ReplayClient("127.0.0.1:1", tls="yes")  # type: ignore[arg-type]


# --------------------------------------------------------- server TLS files


@pytest.mark.parametrize("problem", ["missing cert", "key of another cert", "bad client ca"])
def test_a_bad_tls_file_is_refused_naming_it(pki, tmp_path, problem) -> None:
    from replay_server.errors import ConfigError
    from replay_server.service.credentials import server_credentials
    from replay_server.service.settings import ServerSettings

    server, other = pki["server"], pki["client"]
    cert, key, client_ca = server.cert, server.key, None
    if problem == "missing cert":
        cert = tmp_path / "missing.crt"
        expected = f"server.tls_cert_file: cannot read '{cert}'"
    elif problem == "key of another cert":
        key = other.key
        expected = "are not a PEM certificate chain and its private key"
    else:
        client_ca = tmp_path / "garbage.crt"
        client_ca.write_text("not a certificate\n")
        expected = f"server.tls_client_ca_file '{client_ca}' holds no PEM CA certificate"
    settings = ServerSettings(tls_cert_file=str(cert), tls_key_file=str(key),
                              tls_client_ca_file=None if client_ca is None else str(client_ca))
    with pytest.raises(ConfigError, match=re.escape(expected)):
        server_credentials(settings)


def test_a_bad_tls_file_stops_the_server_at_start(pki, tmp_path) -> None:
    """Through ``replay-server serve``: exit status 2 and the reason."""
    config = tmp_path / "bad.toml"
    config.write_text(f'[server]\naddress = "127.0.0.1:0"\ntls_cert_file = "{pki["server"].cert}"\n'
                      f'tls_key_file = "{pki["client"].key}"\n' + TABLES)
    result = _cli("serve", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert "are not a PEM certificate chain and its private key" in result.stderr


@pytest.mark.parametrize("days, why", [((-30, -1), "has expired"),
                                       ((1, 30), "is not valid yet")])
def test_an_expired_server_certificate_stops_the_server_at_start(pki, tmp_path, days,
                                                                   why) -> None:
    """Issue 23, finding 10: an expired certificate was accepted at start; every client's
    handshake then failed with gRPC's generic errors."""
    from tests.certs import Authority

    pem = Authority(tmp_path, "dated CA").server("dated", valid_days=days)
    config = tmp_path / "dated.toml"
    config.write_text(f'[server]\naddress = "127.0.0.1:0"\ntls_cert_file = "{pem.cert}"\n'
                      f'tls_key_file = "{pem.key}"\n' + TABLES)
    result = _cli("serve", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert f"server.tls_cert_file '{pem.cert}': the certificate {why} (valid from " in (
        result.stderr)
    assert "Traceback" not in result.stderr


def test_a_tls_client_of_a_plaintext_server_is_told_so(server, pki) -> None:
    _refused(ReplayClient(server.address, tls=TlsConfig.from_files(ca=pki["ca"].cert),
                          timeout=10, max_retry_s=0),
             "the TLS handshake with .* failed .*or the server speaks plaintext: no tls=")
