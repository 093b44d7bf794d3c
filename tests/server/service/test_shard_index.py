"""``shard = "auto"``: the StatefulSet pod's ordinal, from REPLAY_SHARD_INDEX or the host name."""

from __future__ import annotations

import pytest

from replay_server.errors import ConfigError
from replay_server.service.settings import ServerSettings
from replay_server.service.shard_index import resolve_shard


def test_auto_reads_the_pod_index_variable_first_then_the_host_name() -> None:
    assert resolve_shard("auto", {"REPLAY_SHARD_INDEX": "7"}, "replay-server-2") == 7
    assert resolve_shard("auto", {}, "replay-server-2") == 2
    assert resolve_shard("auto", {"REPLAY_SHARD_INDEX": ""}, "my-replay-12") == 12
    assert resolve_shard(5, {}, "laptop") == 5


@pytest.mark.parametrize("value, environ, host, message", [
    ("auto", {}, "laptop", "host name 'laptop' does not end in -<ordinal>"),
    ("auto", {"REPLAY_SHARD_INDEX": "two"}, "x-1", "REPLAY_SHARD_INDEX='two' is not a shard"),
    ("auto", {"REPLAY_SHARD_INDEX": "128"}, "x-1", "not a shard index"),
    ("auto", {}, "replay-server-200", "does not end in -<ordinal> in \\[0, 127\\]"),
    ("first", {}, "x-1", "integer in \\[0, 127\\] or \"auto\", got 'first'"),
    (128, {}, "x-1", "server.shard must be an integer in \\[0, 127\\]"),
])
def test_what_cannot_be_a_shard_index_is_refused_saying_what_to_set(
        value, environ, host, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_shard(value, environ, host)


def test_settings_hold_the_resolved_index(monkeypatch) -> None:
    monkeypatch.setenv("REPLAY_SHARD_INDEX", "3")
    assert ServerSettings(shard="auto").shard == 3
