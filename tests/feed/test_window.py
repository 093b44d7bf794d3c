"""The window's growth rule, on a clock the test moves (no link, no sleeping)."""

from __future__ import annotations

import math

import pytest

from replay_feed import window as window_module
from replay_feed.credits import CreditFlow, CreditQueue
from replay_feed.window import SAMPLE, SAMPLE_S, WindowGrowth


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(window_module.time, "perf_counter", clock)
    return clock


def grower(budget: float = 1e9, batch: float = 1e6, may_grow=lambda: True):
    flow = CreditFlow(CreditQueue(), 2)
    notes: list[str] = []
    return flow, WindowGrowth(flow, budget, lambda: batch, may_grow, notes.append), notes


def take(growth: WindowGrowth, clock: Clock, rate: float, waited: float) -> None:
    """One decision's worth of takes at ``rate`` batches/s, each having waited ``waited`` s."""
    for _ in range(max(SAMPLE, math.ceil(SAMPLE_S * rate) + 1)):
        clock.now += 1 / rate
        growth.took(waited)


def test_a_starving_learner_widens_the_window_while_it_helps_then_it_stays(clock) -> None:
    flow, growth, notes = grower()
    take(growth, clock, 100, 0.01)
    assert flow.window == 3  # grown by half, at least one
    take(growth, clock, 150, 0.01)
    assert flow.window == 4
    take(growth, clock, 151, 0.01)  # wider brought nothing: the link limits now
    assert flow.window == 4 and "no faster" in notes[0]
    take(growth, clock, 300, 0.01)
    assert flow.window == 4  # settled for good


def test_a_fed_learner_or_a_fixed_transport_keeps_the_window(clock) -> None:
    flow, growth, _ = grower()
    take(growth, clock, 100, 0.0)  # never waited
    assert flow.window == 2
    flow, growth, _ = grower(may_grow=lambda: False)  # a shared-memory ring
    take(growth, clock, 100, 0.01)
    assert flow.window == 2


def test_the_window_never_passes_the_memory_budget(clock) -> None:
    flow, growth, notes = grower(budget=5e6, batch=1e6)  # 5 batches: 4 ahead at most
    rate = 100.0
    for _ in range(10):
        take(growth, clock, rate, 0.01)
        rate *= 2
    assert flow.window == 4 and "budget" in notes[0]
