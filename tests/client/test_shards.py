"""The sharded client's surface and its refusals, before any server is involved."""

from __future__ import annotations

import inspect
import pickle

import pytest

from replay_client import ReplayApi, ReplayClient, ServerClient
from replay_client.sharded.discovery import addresses_of, system_resolver
from replay_client.errors import (
    InvalidArgumentError,
    ShardingError,
    UnavailableError,
    UnsupportedError,
)
from replay_client.sharded.client import ShardedClient


def test_one_address_is_the_plain_client_and_many_are_the_sharded_one() -> None:
    plain = ReplayClient("127.0.0.1:1")
    assert type(plain) is ServerClient
    client = ReplayClient(["127.0.0.1:1", "127.0.0.1:2"], timeout=3.0)
    assert isinstance(client, ShardedClient) and client.timeout == 3.0
    assert isinstance(ReplayClient("shards://replay:50051"), ShardedClient)
    for made in (plain, client):  # the front door's name holds for both, as does the protocol
        assert isinstance(made, ReplayClient) and isinstance(made, ReplayApi)
    with pytest.raises(InvalidArgumentError, match="apply to a sharded client"):
        ReplayClient("127.0.0.1:1", allow_degraded=True)
    with pytest.raises(InvalidArgumentError, match="address must be"):
        ReplayClient(5)


def _protocol_calls() -> list[str]:
    return sorted(n for n, v in vars(ReplayApi).items()
                  if callable(v) and (not n.startswith("_") or n in ("__enter__", "__exit__")))


@pytest.mark.parametrize("implementation", [ServerClient, ShardedClient])
def test_both_clients_implement_every_call_of_the_protocol_with_its_signature(
        implementation) -> None:
    """Nothing silently falls through to one shard or to the protocol's empty body: each
    call is the implementation's own (or a base class's of its own, never ReplayApi's)."""
    for name in _protocol_calls():
        assert _owner(implementation, name) not in (None, ReplayApi, object), (
            implementation.__name__, name)
        declared = inspect.signature(getattr(ReplayApi, name)).parameters
        actual = inspect.signature(getattr(implementation, name)).parameters
        assert list(declared) == list(actual), (implementation.__name__, name)
        for parameter in declared:  # keyword-only stays keyword-only, defaults agree
            assert declared[parameter].kind == actual[parameter].kind, (name, parameter)
    for name in ("address", "timeout"):
        assert isinstance(getattr(implementation, name), property), name


def _owner(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name``."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def test_the_sharded_client_has_every_public_call_of_the_plain_one() -> None:
    # What the sharded layer builds on (one server's connection and stream link) is not a call.
    public = {n for n in dir(ServerClient) if not n.startswith("_")} - {"connection", "link"}
    missing = {n for n in public if _owner(ShardedClient, n) in (None, object)}
    assert not missing, missing


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
    assert isinstance(copy, ShardedClient)
    assert copy.address == ["127.0.0.1:1", "127.0.0.1:2"] and copy.timeout == 2.0
