"""The split pool: every task runs once, the caller's part included; a failure surfaces after all parts."""

from __future__ import annotations

import threading

import pytest

from replay_server.engine import workers


def test_every_task_runs_once_across_the_parts():
    seen: list[int] = []
    threads: set[str] = set()
    lock = threading.Lock()

    def work(task: int) -> None:
        with lock:
            seen.append(task)
            threads.add(threading.current_thread().name)

    workers.run_split(work, list(range(10)), 3)
    assert sorted(seen) == list(range(10))
    assert threading.current_thread().name in threads  # the caller did a part itself


def test_a_failing_part_is_raised_once_every_part_finished():
    finished: list[int] = []

    def work(task: int) -> None:
        if task == 1:
            raise ValueError("task 1 failed")
        finished.append(task)

    with pytest.raises(ValueError, match="task 1 failed"):
        workers.run_split(work, [0, 1, 2, 3], 2)
    assert sorted(finished) == [0, 2]  # the other part ran to its end (tasks 0 and 2)
