"""replay_proto.addresses: which addresses keep traffic on this host."""

from __future__ import annotations

import pytest

from replay_proto.addresses import is_loopback


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "127.1.2.3:1", "localhost:50051",
                                     "[::1]:50051"])
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "10.0.0.5:50051", "[::]:50051",
                                     "replay.internal:50051", "localhost.example.com:1",
                                     "dns:///localhost:50051", "192.168.1.2:80"])
def test_addresses_that_reach_other_hosts(address: str) -> None:
    assert not is_loopback(address)
