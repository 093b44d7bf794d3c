"""replay_proto.addresses: which addresses keep traffic on this host."""

from __future__ import annotations

import pytest

from replay_proto.addresses import AddressError, is_loopback, with_port


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
])
def test_an_address_without_a_port_gets_the_default_port(given: str, meant: str) -> None:
    assert with_port(given) == meant


@pytest.mark.parametrize("address", ["", "localhost:http", "localhost:70000", "[::1]x",
                                     "host:"])
def test_a_malformed_address_is_refused_naming_it(address: str) -> None:
    with pytest.raises(AddressError, match="address|empty"):
        with_port(address)
