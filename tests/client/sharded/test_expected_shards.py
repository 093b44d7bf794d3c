"""A name that says how many shards the replay has: a missing shard is known, never ignored.

``shards://NAME:PORT?expected=N`` (and a registry's :class:`Resolution`, as
``ray://`` names give) tell the client the whole replay. Two real servers
(shards 0 and 1, in this process, on 127.0.0.1) stand for a replay of three
whose shard 2 is restarting: a strict client waits, then refuses naming shard
2; a degraded one samples the two and lists shard 2 in ``missing_shards``;
when shard 2 comes, both take it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from replay_client import ReplayClient
from replay_client.errors import InvalidArgumentError, ShardingError, UnavailableError
from replay_client.sharded.discovery import Resolution, ShardState
from replay_client.sharded.ray_registry import resolution_of
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer
from tests.conftest import wait_for

NAME = "shards://replay.replay.svc:50051"


def _server(shard: int) -> EmbeddedServer:
    return EmbeddedServer(settings_from_dict({
        "server": {"address": "127.0.0.1:0", "shard": shard, "shared_memory": False},
        "tables": [{"name": "u", "capacity": 1000, "sampler": "uniform"},
                   {"name": "p", "capacity": 1000, "sampler": "prioritized"}]}))


@pytest.fixture(scope="module")
def pair() -> Iterator[list[EmbeddedServer]]:
    servers = [_server(0), _server(1)]
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def names(pair) -> list[str]:
    """What the name resolves to now (a test may add or remove addresses)."""
    for server in pair:
        for table in ("u", "p"):
            ReplayClient(server.address).reset(table)
    return [s.address for s in pair]


def _fill(client) -> None:
    for start in range(0, 40, 8):
        client.insert("u", {"key": torch.arange(start, start + 8, dtype=torch.int64)})


def test_a_strict_client_refuses_a_replay_missing_a_shard_and_names_it(names) -> None:
    client = ReplayClient(f"{NAME}?expected=3", resolver=lambda h, p: list(names),
                          wait_for_shards_s=0.3)
    with pytest.raises(UnavailableError, match=r"1 of 3 shards not found.*shard 2"):
        client.sample("u", 8)
    with pytest.raises(UnavailableError, match="allow_degraded=True"):
        client.insert("u", {"key": torch.arange(4, dtype=torch.int64)})
    for address in names:  # nothing was inserted anywhere
        assert ReplayClient(address).info()["u"].size == 0
    client.close()


def test_without_the_count_the_same_two_servers_are_taken_for_the_whole(names) -> None:
    """What the count fixes: a name alone cannot tell two shards from two of three."""
    with ReplayClient(NAME, resolver=lambda h, p: list(names)) as client:
        _fill(client)
        assert client.sample("u", 8).missing_shards == ()


def test_a_degraded_client_lists_the_missing_shard_in_every_sample_and_stream(names) -> None:
    client = ReplayClient(f"{NAME}?expected=3", resolver=lambda h, p: list(names),
                          allow_degraded=True)
    try:
        _fill(client)
        assert client.sample("u", 8).missing_shards == (2,)
        assert 2 in client.shard_stats().down
        stream = client.stream("u", 8, num_batches=3)
        assert [b.missing_shards for b in stream] == [(2,)] * 3
        # a learner's update naming rows of the missing shard (drawn before it went down)
        client.insert("p", {"key": torch.arange(16)})
        ids = torch.cat([client.sample("p", 8).ids.unique(),
                         torch.tensor([2 << 56 | 1 << 40 | 5])])
        skipped = client.shard_stats().skipped_updates
        assert client.update_priorities("p", ids, torch.ones(len(ids))) == len(ids) - 1
        assert client.shard_stats().skipped_updates == skipped + 1
    finally:
        client.close()


def test_the_missing_shard_joins_both_clients_when_it_comes(names) -> None:
    strict = ReplayClient(f"{NAME}?expected=3", resolver=lambda h, p: list(names),
                          wait_for_shards_s=0.2)
    lenient = ReplayClient(f"{NAME}?expected=3", resolver=lambda h, p: list(names),
                           allow_degraded=True)
    third = _server(2)
    try:
        _fill(lenient)
        with pytest.raises(UnavailableError, match="shard 2"):
            strict.info()
        names.append(third.address)  # shard 2 is back (a pod ready, an actor restarted)
        assert sorted(strict.shards) == [0, 1, 2]
        assert wait_for(lambda: lenient.sample("u", 8).missing_shards == (), timeout=10)
        assert 2 not in lenient.shard_stats().down
    finally:
        strict.close()
        lenient.close()
        third.close()


def test_a_server_beyond_the_expected_count_is_refused(names) -> None:
    client = ReplayClient(f"{NAME}?expected=1", resolver=lambda h, p: list(names))
    with pytest.raises(ShardingError, match="expects shards 0..0.*reports shard 1"):
        client.info()
    client.close()


@pytest.mark.parametrize("query", ["expected=0", "expected=x", "expected=129", "replicas=3"])
def test_a_bad_expected_count_is_refused_before_connecting(query) -> None:
    client = ReplayClient(f"{NAME}?{query}", resolver=lambda h, p: ["127.0.0.1:1"])
    with pytest.raises(InvalidArgumentError, match="expected"):
        client.info()


def test_a_registry_says_why_a_shard_is_missing(names) -> None:
    """A resolver with states (what ``ray://`` names resolve to), without Ray."""
    listed = {"expected": 3, "shards": [
        {"index": 0, "state": "serving", "address": names[0], "incarnation": 1},
        {"index": 1, "state": "serving", "address": names[1], "incarnation": 1},
        {"index": 2, "state": "restarting", "address": None, "incarnation": 2}]}
    resolution = resolution_of(listed)
    assert resolution == Resolution(tuple(names), 3, (
        ShardState(0, "serving", names[0], 1), ShardState(1, "serving", names[1], 1),
        ShardState(2, "restarting", None, 2)))
    client = ReplayClient("ray://replay/test", resolver=lambda ns, n: resolution,
                          wait_for_shards_s=0.2)
    with pytest.raises(UnavailableError, match=r"shard 2 is restarting \(incarnation 2\)"):
        client.sample("u", 8)
    client.close()
    with ReplayClient("ray://replay/test", resolver=lambda ns, n: resolution,
                      allow_degraded=True) as degraded:
        _fill(degraded)
        batch = degraded.sample("u", 8)
        assert batch.missing_shards == (2,)
        assert "restarting" in degraded.shard_stats().down[2]


def test_a_ray_name_is_checked_and_needs_a_connected_ray() -> None:
    with pytest.raises(InvalidArgumentError, match="ray://NAMESPACE/NAME"):
        ReplayClient("ray://only-a-name", resolver=lambda ns, n: []).info()
