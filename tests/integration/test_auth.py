"""Token auth: calls without the right token are UNAUTHENTICATED; health needs none."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from replay_client import ReplayClient, errors

from tests.conftest import module_server

CONFIG = '[server]\nauth_token_env = "TEST_REPLAY_TOKEN"\n[[tables]]\nname = "t"\ncapacity = 100\n'


server = module_server(CONFIG, env={"TEST_REPLAY_TOKEN": "s3cret"})


def test_a_call_without_token_is_unauthenticated(server):
    with pytest.raises(errors.UnauthenticatedError, match="authorization: Bearer"):
        ReplayClient(server.address, token="").info()


def test_a_wrong_token_is_unauthenticated_also_for_streams(server):
    client = ReplayClient(server.address, token="wrong")
    with pytest.raises(errors.UnauthenticatedError):
        client.insert("t", {"x": torch.zeros(1)})
    with pytest.raises(errors.UnauthenticatedError):
        next(iter(client.stream("t", 1)))


def test_the_right_token_works(server):
    client = ReplayClient(server.address, token="s3cret")
    client.insert("t", {"x": torch.zeros(2)})
    assert client.info()["t"].size == 2


def test_health_needs_no_token(server):
    result = subprocess.run(
        [sys.executable, "-m", "replay_server.app.cli", "health", "--address", server.address],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert result.returncode == 0 and "SERVING" in result.stdout


def test_a_server_whose_token_variable_is_unset_refuses_to_start(tmp_path):
    from tests.conftest import start_server

    with pytest.raises(RuntimeError, match="TEST_REPLAY_TOKEN.*unset or empty"):
        start_server(tmp_path, CONFIG, env={"TEST_REPLAY_TOKEN": ""})
