"""ChangeClock: waiters wake on a change or a wake-up after their mark, never miss one."""

from __future__ import annotations

import threading

from replay_server.engine.change_clock import ChangeClock
from tests.conftest import wait_for


def test_a_change_after_the_mark_wakes_the_waiter() -> None:
    clock = ChangeClock()
    mark = clock.mark()
    woke = threading.Event()

    def waiter() -> None:
        if clock.wait(mark, timeout=30):
            woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert wait_for(lambda: clock.waiters == 1)
    clock.tick()
    thread.join(10)
    assert woke.is_set() and clock.waiters == 0


def test_a_change_between_mark_and_wait_is_not_lost() -> None:
    clock = ChangeClock()
    mark = clock.mark()
    clock.tick()  # before the waiter gets to wait
    assert clock.wait(mark, timeout=0) is True


def test_wake_releases_waiters_without_a_change() -> None:
    clock = ChangeClock()
    mark = clock.mark()
    results = []
    thread = threading.Thread(target=lambda: results.append(clock.wait(mark, timeout=30)))
    thread.start()
    assert wait_for(lambda: clock.waiters == 1)
    clock.wake()
    thread.join(10)
    assert results == [True] and clock.now == 0  # woken, though nothing changed


def test_a_wait_without_change_times_out() -> None:
    clock = ChangeClock()
    assert clock.wait(clock.mark(), timeout=0.01) is False


def test_table_operations_tick_the_clock() -> None:
    import torch

    from replay_server import Table, TableConfig

    table = Table(TableConfig(name="t", capacity=10, sampler="prioritized"))
    marks = [table.changes.now]
    ids = table.insert({"x": torch.zeros(3)})
    marks.append(table.changes.now)
    table.sample(2)
    marks.append(table.changes.now)
    table.update_priorities(ids, torch.ones(3))
    marks.append(table.changes.now)
    table.reset()
    marks.append(table.changes.now)
    assert marks == sorted(set(marks)) and len(marks) == 5
