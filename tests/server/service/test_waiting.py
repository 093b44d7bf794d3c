"""replay_server.service.waiting: rate-limited calls wait for a change, not in a thread.

Driven in-process on an event loop with fake attempts (no gRPC): a blocked
call retries only after its table changed (and the limiter hint says it may
pass), never misses a change reported while its attempt was running, gives up
shortly before its deadline with the limiter's message, and stops waiting when
the server drains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from replay_server.errors import RateLimitedError
from replay_server.service.status import ShuttingDownError, status_of
from replay_server.service.waiting import BlockedCalls


def blocked(table: str = "replay") -> RateLimitedError:
    return RateLimitedError(f"table {table!r}: sample of 4 rows blocked by the rate limiter "
                            f"(inserts=1, samples=0)", table=table, operation="sample", count=4)


class Attempts:
    """An attempt that is held back ``blocked_times`` times, then returns "batch"."""

    def __init__(self, blocked_times: int, table: str = "replay",
                 during: Callable[[], None] | None = None) -> None:
        self.left, self.table, self.during, self.calls = blocked_times, table, during, 0

    async def __call__(self) -> str:
        self.calls += 1
        await asyncio.sleep(0)
        if self.during is not None:
            self.during()
        if self.left:
            self.left -= 1
            raise blocked(self.table)
        return "batch"


def run(coroutine):
    return asyncio.run(coroutine)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_blocked_call_retries_after_its_table_changes_and_returns() -> None:
    async def scenario() -> None:
        calls = BlockedCalls(lambda table, operation, count: True)
        attempts = Attempts(1)
        task = asyncio.create_task(calls.run(attempts, time_remaining=lambda: None,
                                             stopping=lambda: False))
        await settle()
        assert (attempts.calls, calls.waiting("replay", "sample")) == (1, 1)
        calls.changed("other")                       # another table: still waiting
        await settle()
        assert attempts.calls == 1 and not task.done()
        calls.changed("replay")
        assert await task == "batch"
        assert (attempts.calls, calls.waiting("replay", "sample")) == (2, 0)

    run(scenario())


def test_change_reported_while_the_attempt_ran_is_not_lost() -> None:
    async def scenario() -> None:
        calls = BlockedCalls(lambda table, operation, count: True)
        attempts = Attempts(1, during=lambda: calls.changed("replay"))
        result = await asyncio.wait_for(
            calls.run(attempts, time_remaining=lambda: None, stopping=lambda: False), 30)
        assert (result, attempts.calls) == ("batch", 2)

    run(scenario())


def test_change_that_cannot_help_does_not_retry() -> None:
    async def scenario() -> None:
        allowed = [False]
        calls = BlockedCalls(lambda table, operation, count: allowed[0])
        attempts = Attempts(1)
        task = asyncio.create_task(calls.run(attempts, time_remaining=lambda: None,
                                             stopping=lambda: False))
        await settle()
        calls.changed("replay")
        await settle()
        assert attempts.calls == 1 and not task.done()
        allowed[0] = True
        calls.changed("replay")
        assert await task == "batch"

    run(scenario())


def test_blocked_call_gives_up_before_its_deadline_naming_the_limiter_state() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.3
        calls = BlockedCalls(lambda table, operation, count: True)
        with pytest.raises(RateLimitedError) as info:
            await calls.run(Attempts(10**6), time_remaining=lambda: deadline - loop.time(),
                            stopping=lambda: False)
        assert loop.time() < deadline
        assert str(info.value) == (
            "table 'replay': sample of 4 rows blocked by the rate limiter (inserts=1, "
            "samples=0) until the deadline")
        assert status_of(info.value)[1] == "deadline_exceeded"
        assert calls.waiting("replay", "sample") == 0

    run(scenario())


def test_draining_server_wakes_waiters_and_they_give_up() -> None:
    async def scenario() -> None:
        stopping = [False]
        calls = BlockedCalls(lambda table, operation, count: True)
        task = asyncio.create_task(calls.run(Attempts(10**6), time_remaining=lambda: None,
                                             stopping=lambda: stopping[0]))
        await settle()
        stopping[0] = True
        calls.changed()
        with pytest.raises(ShuttingDownError):
            await task

    run(scenario())


def test_other_errors_pass_through_at_once() -> None:
    async def failing() -> str:
        raise ValueError("bad request")

    async def scenario() -> None:
        calls = BlockedCalls(lambda table, operation, count: True)
        with pytest.raises(ValueError, match="bad request"):
            await calls.run(failing, time_remaining=lambda: None, stopping=lambda: False)

    run(scenario())
