"""call_metadata: the request size a client declares, as the server reads it."""

from __future__ import annotations

import pytest

from replay_proto.call_metadata import (
    REQUEST_BYTES_KEY,
    declared_request_bytes,
    request_bytes_metadata,
)


def test_a_declared_size_round_trips() -> None:
    assert request_bytes_metadata(123) == ((REQUEST_BYTES_KEY, "123"),)
    assert declared_request_bytes(request_bytes_metadata(123), 64, 1000) == 123


@pytest.mark.parametrize(("metadata", "expected"), [
    ((), 64),                                       # not declared: the default
    (((REQUEST_BYTES_KEY, "-5"),), 64),             # malformed: the default
    (((REQUEST_BYTES_KEY, "lots"),), 64),
    (((REQUEST_BYTES_KEY, "5000"),), 1000),         # never more than the message limit
    ((("other", "1"), (REQUEST_BYTES_KEY, b"7")), 7),
])
def test_what_the_server_reserves_for_odd_or_missing_declarations(metadata, expected) -> None:
    assert declared_request_bytes(metadata, 64, 1000) == expected
