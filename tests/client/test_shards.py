"""The sharded client's surface and its refusals, before any server is involved."""

from __future__ import annotations

import inspect
import pickle

import pytest

from replay_client import ReplayClient
from replay_client.discovery import addresses_of, system_resolver
from replay_client.errors import (
    InvalidArgumentError,
    ShardingError,
    UnavailableError,
    UnsupportedError,
)
from replay_client.shards import ShardedReplayClient


def test_one_address_is_the_plain_client_and_many_are_the_sharded_one() -> None:
    assert type(ReplayClient("127.0.0.1:1")) is ReplayClient
    client = ReplayClient(["127.0.0.1:1", "127.0.0.1:2"], timeout=3.0)
    assert isinstance(client, ShardedReplayClient) and client.timeout == 3.0
    assert isinstance(ReplayClient("shards://replay:50051"), ShardedReplayClient)


def test_the_sharded_client_has_every_call_of_the_plain_one() -> None:
    """Nothing silently falls through to one shard: each public name is the sharded one's own."""
    public = {n for n in dir(ReplayClient) if not n.startswith("_")}
    missing = {n for n in public if n not in ShardedReplayClient.__dict__}
    assert not missing, missing
    for name in ("insert", "sample", "update_priorities", "reset", "fetch", "publish"):
        plain = inspect.signature(getattr(ReplayClient, name)).parameters
        sharded = inspect.signature(getattr(ShardedReplayClient, name)).parameters
        assert list(plain) == list(sharded), name


def test_bad_shard_lists_are_refused_before_connecting() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one address"):
        ReplayClient([])
    with pytest.raises(ShardingError, match="more than once"):
        ReplayClient(["127.0.0.1:1", "127.0.0.1:1"])
    with pytest.raises(InvalidArgumentError, match="'host:port' strings"):
        ReplayClient(["127.0.0.1:1", 5])
    with pytest.raises(InvalidArgumentError, match="shards://NAME:PORT"):
        addresses_of("shards://replay")
    with pytest.raises(UnavailableError, match="resolves to no address"):
        addresses_of("shards://replay:50051", lambda host, port: [])


def test_a_numeric_host_resolves_without_any_lookup() -> None:
    assert system_resolver("127.0.0.1", 50051) == ["127.0.0.1:50051"]
    assert system_resolver("::1", 7) == ["[::1]:7"]


def test_calls_a_sharded_client_does_not_offer_say_what_to_use() -> None:
    client = ReplayClient(["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(UnsupportedError, match="shard_info"):
        client.server_info()
    with pytest.raises(InvalidArgumentError, match="prefetch must be an integer >= 1"):
        client.stream("replay", 4, prefetch=0)  # refused before connecting


def test_it_pickles_as_its_settings() -> None:
    client = ReplayClient(["127.0.0.1:1", "127.0.0.1:2"], seed=3, timeout=2.0)
    copy = pickle.loads(pickle.dumps(client))
    assert isinstance(copy, ShardedReplayClient)
    assert copy.address == ["127.0.0.1:1", "127.0.0.1:2"] and copy.timeout == 2.0
