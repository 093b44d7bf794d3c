"""The memory bound the default limits give (docs/service.md, "Limits"), max_streams and
max_host_share."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from replay_server.errors import ConfigError
from replay_server.service.limits import (MIB, WAITER_BYTES, WINDOW_BYTES, ServiceLimits,
                                         check_limits)
from replay_server.service.settings import ServerSettings

DOCS = Path(__file__).resolve().parents[3] / "docs" / "service.md"


def test_the_default_bound_fits_a_small_host_and_is_the_one_documented() -> None:
    """With 1,024 waiting calls counted as whole messages the default bound was about
    11 GiB. A waiting unary call has read its request (in the budget): it holds its window
    and its state (measured 25 KiB per waiting fetch); streams hold a message each and have
    their own cap. The default bound is about 4.1 GiB, as docs/service.md says."""
    limits = ServiceLimits.of(ServerSettings())
    per_reader = 2 * limits.max_message_bytes + WINDOW_BYTES
    assert limits.transport_bound_bytes == (
        limits.memory_budget_bytes + (256 + 128) * per_reader + 1024 * WAITER_BYTES)
    gib = limits.transport_bound_bytes / (1024 * MIB)
    assert gib < 4.5  # an 8 GiB host keeps room for its tables
    stated = re.search(r"that is about ([\d.]+) GiB at most", DOCS.read_text())
    assert stated and float(stated.group(1)) == round(gib, 1)


def test_max_streams_is_validated_and_never_more_than_the_waiting_pool() -> None:
    settings = ServerSettings()
    with pytest.raises(ConfigError, match="server.max_streams must be an integer"):
        check_limits(replace(settings, max_streams=0))
    assert ServiceLimits.of(replace(settings, max_waiting_calls=8)).max_streams == 8
    assert ServiceLimits.of(replace(settings, max_streams=16)).max_streams == 16


def test_max_host_share_is_validated_and_reported() -> None:
    settings = ServerSettings()
    assert ServiceLimits.of(settings).max_host_share == 0.75  # the default
    for bad in (0, -0.5, 1.01, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ConfigError, match="server.max_host_share must be a number in"):
            check_limits(replace(settings, max_host_share=bad))
    limits = ServiceLimits.of(replace(settings, max_host_share=1))
    assert limits.max_host_share == 1.0 and limits.describe()["max_host_share"] == 1.0
    assert "1 of each per address" in limits.summary()
