"""reset_meter: a connection that ends more calls without a word than the limit in a second."""

from __future__ import annotations

from replay_server.service.reset_meter import ResetMeter


def test_a_connection_over_the_limit_within_a_second_is_named_once() -> None:
    meter = ResetMeter(3)
    assert [meter.ended_silent("ipv4:127.0.0.5:1", now=10.0) for _ in range(5)] == [
        False, False, False, True, False]
    assert not meter.ended_silent("ipv4:127.0.0.5:2", now=10.5)  # another connection
    assert meter.cut == 1


def test_the_count_starts_again_each_second() -> None:
    meter = ResetMeter(3)
    for second in range(5):  # three a second, for five seconds: never over
        assert not any(meter.ended_silent("ipv4:127.0.0.5:1", now=second + 0.1 * i)
                       for i in range(3))
    assert meter.cut == 0
