"""Backoff: the client's one retry schedule (jittered doubling inside a window and a deadline)."""

from __future__ import annotations

import time

import pytest

from replay_feed.backoff import Backoff


def test_delays_double_up_to_the_maximum_with_jitter_of_half_either_way() -> None:
    backoff = Backoff(3600, initial_s=0.1, max_s=0.4)
    bases = [0.1, 0.2, 0.4, 0.4, 0.4]
    for base in bases:
        delay = backoff.next_delay()
        assert delay is not None and 0.5 * base <= delay <= 1.5 * base


def test_no_delay_is_given_that_would_end_past_the_window() -> None:
    backoff = Backoff(0.25, initial_s=0.1, max_s=1.0)
    assert backoff.next_delay() is not None  # 0.1 fits
    assert backoff.next_delay() is not None  # 0.1 + 0.2 ... the window is measured from now
    assert backoff.next_delay() is None       # 0.4 would end past 0.25 s


def test_a_deadline_ends_retries_before_the_window_does() -> None:
    backoff = Backoff(3600, deadline=time.monotonic() + 0.05, initial_s=0.1)
    assert backoff.next_delay() is None


@pytest.mark.parametrize("window", [0.0, -1.0])
def test_an_empty_window_allows_no_retry(window: float) -> None:
    assert Backoff(window).next_delay() is None
