"""replay_proto.addresses: which addresses keep traffic on this host."""

from __future__ import annotations

import pytest

from replay_proto.addresses import AddressError, check_address, is_loopback, with_port


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "127.1.2.3:1", "localhost:50051",
                                     "[::1]:50051"])
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "10.0.0.5:50051", "[::]:50051",
                                     "replay.internal:50051", "localhost.example.com:1",
                                     "dns:///localhost:50051", "192.168.1.2:80"])
def test_addresses_that_reach_other_hosts(address: str) -> None:
    assert not is_loopback(address)


@pytest.mark.parametrize(("given", "meant"), [
    ("localhost", "localhost:50051"),          # gRPC alone would dial port 443
    ("localhost:1234", "localhost:1234"),
    ("10.0.0.5", "10.0.0.5:50051"),
    ("::1", "[::1]:50051"),
    ("[::1]", "[::1]:50051"),
    ("[::1]:7", "[::1]:7"),
    ("dns:///replay.internal:50051", "dns:///replay.internal:50051"),
    ("unix:/tmp/replay.sock", "unix:/tmp/replay.sock"),
    ("ipv4:127.0.0.1:5", "ipv4:127.0.0.1:5"),
])
def test_an_address_without_a_port_gets_the_default_port(given: str, meant: str) -> None:
    assert with_port(given) == meant
    assert check_address(given) == meant


@pytest.mark.parametrize("address", ["", "localhost:http", "localhost:70000", "[::1]x",
                                     "host:"])
def test_a_malformed_address_is_refused_naming_it(address: str) -> None:
    with pytest.raises(AddressError, match="address|empty"):
        with_port(address)


@pytest.mark.parametrize("address, why", [
    ("", "empty"), ("   ", "empty"), (None, "empty"), (5, "is a string"),
    (":50051", "names no host"), ("localhost:", "not a number"),
    ("localhost:99999", "not a number from 0 to 65535"), ("localhost:0", "port 0 names no server"),
    ("localhost:-1", "not a number"), ("localhost:http", "not a number"),
    ("::1:50051", "no IPv6 address"), ("[::1:50051", "expected"), ("[nope]:1", "no IPv6 address"),
    ("local host:1", "white space"),
])
def test_addresses_a_client_cannot_dial_are_refused_naming_why(address, why: str) -> None:
    with pytest.raises(AddressError, match=why):
        check_address(address)


def test_port_zero_is_a_listeners_address_only() -> None:
    assert with_port("127.0.0.1:0") == "127.0.0.1:0"


def test_a_huge_address_is_shortened_in_the_message() -> None:
    for address in ("x" * 100_000 + ":99999", "[" + "1" * 100_000 + "]:1", "x:" + "9" * 100_000):
        with pytest.raises(AddressError) as info:
            check_address(address)
        assert len(str(info.value)) < 300
