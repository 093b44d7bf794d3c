"""The replay client's keepalive pings stay within what the server accepts: real server, real client.

gRPC counts a client's ping that comes sooner than the server accepts (on a connection the
server sends nothing on) as a strike and closes the connection after two (GOAWAY
``too_many_pings``), failing every call on it. The server accepts a ping every
``min(keepalive_s, 10 s)`` (``client_ping_floor_s``); the client pings every 60 s while a
call is open (``replay_client.connection.KEEPALIVE_S``), also on a call that waits long
without data (a sample waiting for rows, a stream).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from replay_client import ReplayClient, connection
from replay_client.errors import DeadlineExceededError, UnavailableError
from replay_server.service.limits import (
    CLIENT_PING_FLOOR_S, DEFAULTS, ServiceLimits, client_ping_floor_s)
from tests.conftest import ServerProcess, start_server

CONFIG = """
[server]
keepalive_s = 2
keepalive_timeout_s = 5

[[tables]]
name = "queue"
capacity = 100
sampler = "fifo"
"""
WAIT_S = 13.0
"""How long the sample waits for rows that never come: three pings at 4 s."""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("keepalive"), CONFIG)
    yield proc
    proc.stop()


def accepted_interval_ms(keepalive_s: float) -> int:
    """The server's gRPC option: the shortest interval it accepts between a client's pings."""
    limits = replace(ServiceLimits.defaults(1 << 20), keepalive_s=keepalive_s)
    return dict(limits.keepalive_options())["grpc.http2.min_ping_interval_without_data_ms"]


@pytest.mark.parametrize("keepalive_s", [1.0, 10.0, DEFAULTS["keepalive_s"], 86_400.0])
def test_the_clients_pings_are_never_sooner_than_any_server_accepts(keepalive_s) -> None:
    options = dict(connection.keepalive_options())
    assert options["grpc.keepalive_time_ms"] >= accepted_interval_ms(keepalive_s)
    assert accepted_interval_ms(keepalive_s) == client_ping_floor_s(keepalive_s) * 1000
    assert client_ping_floor_s(keepalive_s) <= CLIENT_PING_FLOOR_S < connection.KEEPALIVE_S


def waits_out(address: str) -> type[Exception]:
    """The error a sample waiting for rows that never come ends with."""
    with ReplayClient(address, timeout=30, max_retry_s=0) as client, \
            pytest.raises((DeadlineExceededError, UnavailableError)) as error:
        client.sample("queue", 10, wait=True, timeout=WAIT_S)
    return error.type


def test_the_server_states_its_keepalive_in_info_and_its_log(server) -> None:
    # What an operator reads to size a proxy's idle timeout, or a client's own pings.
    with ReplayClient(server.address, timeout=30) as client:
        limits = client.server_info().limits
    assert (limits["keepalive_s"], limits["keepalive_timeout_s"]) == (2.0, 5.0)
    assert "pinged every 2 s, closed 5 s after an unanswered ping" in server.log()


def test_pings_as_often_as_accepted_keep_a_waiting_call(server, monkeypatch) -> None:
    # The server accepts a ping every 2 s (keepalive_s = 2); the client, scaled down from its
    # 60 s against 10 s, pings every 4 s through a call that waits 13 s without data.
    monkeypatch.setattr(connection, "KEEPALIVE_S", 4.0)
    assert waits_out(server.address) is DeadlineExceededError  # the wait ended, not the link


def test_pings_sooner_than_accepted_lose_the_connection(server, monkeypatch) -> None:
    # The control: the same call, pinging twice as often as accepted (gRPC's client never
    # pings more than once a second), loses its connection (too_many_pings), so the test
    # above would see it if the client pinged too often.
    monkeypatch.setattr(connection, "KEEPALIVE_S", 1.0)
    assert waits_out(server.address) is UnavailableError
