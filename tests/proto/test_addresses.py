"""replay_proto.addresses: which addresses keep traffic on this host."""

from __future__ import annotations

import pytest

from replay_proto.addresses import AddressError, check_address, is_loopback


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "127.1.2.3:1", "localhost:50051",
                                     "[::1]:50051"])
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "10.0.0.5:50051", "[::]:50051",
                                     "replay.internal:50051", "localhost.example.com:1",
                                     "dns:///localhost:50051", "192.168.1.2:80"])
def test_addresses_that_reach_other_hosts(address: str) -> None:
    assert not is_loopback(address)


@pytest.mark.parametrize("address", ["localhost:50051", "127.0.0.1:1", "[::1]:65535",
                                     "replay-0.replay.default.svc:50051", "dns:///replay:50051",
                                     "unix:/tmp/replay.sock", "ipv4:127.0.0.1:5"])
def test_addresses_a_client_can_dial(address: str) -> None:
    assert check_address(address) == address


@pytest.mark.parametrize("address, why", [
    ("", "must be 'host:port'"), ("   ", "must be 'host:port'"), (None, "must be 'host:port'"),
    ("localhost", "must be 'host:port'"), (":50051", "must be 'host:port'"),
    ("localhost:", "must be 'host:port'"), ("localhost:99999", "port must be a number in 1..65535"),
    ("localhost:0", "port must be a number in 1..65535"), ("localhost:-1", "port must be"),
    ("localhost:http", "port must be"), ("::1:50051", "IPv6 host in brackets"),
    ("[::1:50051", "written"), ("[nope]:1", "not an IPv6 address"),
    ("local host:1", "white space"),
])
def test_addresses_refused_naming_why(address, why: str) -> None:
    with pytest.raises(AddressError, match=why.replace("(", r"\(").replace(".", r"\.")):
        check_address(address)


def test_a_huge_address_is_shortened_in_the_message() -> None:
    with pytest.raises(AddressError) as info:
        check_address("x" * 100_000 + ":99999")
    assert len(str(info.value)) < 300
