"""budget: bytes calls reserve before they hold them; refusals name the limit."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from replay_server.service.budget import SMALL_BYTES, MemoryBudget
from replay_server.service.status import LimitExceededError, OverloadedError, abort

MIB = 1 << 20


def test_reservations_add_up_resize_and_release() -> None:
    budget = MemoryBudget(100 * MIB)
    a = budget.reserve(10 * MIB, "a")
    b = budget.reserve(20 * MIB, "b")
    assert budget.in_use == 30 * MIB
    a.resize(5 * MIB, "a")
    assert budget.in_use == 25 * MIB
    b.release()
    b.release()  # idempotent
    assert budget.in_use == 5 * MIB and budget.peak == 30 * MIB
    a.release(object())  # as a done-callback
    assert budget.in_use == 0


def test_a_call_that_does_not_fit_now_is_overloaded_and_one_that_never_fits_is_over_limit() -> None:
    budget = MemoryBudget(100 * MIB)
    held = budget.reserve(70 * MIB, "held")
    with pytest.raises(OverloadedError, match="calls in flight hold 70.0 MiB of "
                                              "server.memory_budget_mb = 100.0 MiB"):
        budget.reserve(10 * MIB, "a batch")
    with pytest.raises(LimitExceededError, match="more than the 75.0 MiB server.memory_budget_mb "
                                                 "allows any call this large"):
        budget.reserve(80 * MIB, "a huge batch")
    assert budget.in_use == 70 * MIB
    held.release()
    assert budget.reserve(75 * MIB, "the largest call").nbytes == 75 * MIB


def test_small_calls_keep_the_last_quarter_when_large_ones_fill_their_share() -> None:
    budget = MemoryBudget(100 * MIB)
    budget.reserve(75 * MIB, "large")
    smalls = [budget.reserve(SMALL_BYTES, f"small {i}") for i in range(25)]
    assert budget.in_use == 100 * MIB and len(smalls) == 25
    with pytest.raises(OverloadedError):
        budget.reserve(1, "one more")


def test_a_failed_resize_keeps_the_old_size() -> None:
    budget = MemoryBudget(10 * MIB)
    reservation = budget.reserve(MIB, "x")
    with pytest.raises(LimitExceededError):
        reservation.resize(20 * MIB, "x grown")
    assert reservation.nbytes == MIB and budget.in_use == MIB


class _Call:
    """What :func:`abort` asks of a gRPC call: its peer and its abort."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()) -> None:
        raise _Ended(code)

    def cancelled(self) -> bool:
        return False


class _Ended(Exception):
    pass


def test_refused_counts_the_calls_a_refusal_ended_not_the_tries_a_waiter_waited_out() -> None:
    """``refused_calls`` in ``info`` is calls: it counted every refused try, also those of
    calls that waited for room and were served, so it ran ahead of the calls refused."""

    async def scenario() -> MemoryBudget:
        budget = MemoryBudget(10 * MIB, bulk_share=1.0)
        held = budget.reserve(8 * MIB, "held")
        waiter = asyncio.ensure_future(budget.wait(5 * MIB, "waiting"))
        await asyncio.sleep(0.05)  # refused tries: its own, then each offer while held
        held.release()
        await asyncio.wait_for(waiter, 5)  # served
        assert budget.refused == 0
        for nbytes in (8 * MIB, 20 * MIB):  # over now, over ever: each ends its call
            with pytest.raises((OverloadedError, LimitExceededError)) as refusal:
                budget.reserve(nbytes, "a batch")
            with pytest.raises(_Ended) as ended:
                await abort(_Call(), refusal.value)
            assert ended.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        return budget

    assert asyncio.run(scenario()).refused == 2


def test_a_waiter_gets_its_room_when_another_call_releases_it() -> None:
    async def scenario() -> int:
        budget = MemoryBudget(10 * MIB, bulk_share=1.0)
        held = budget.reserve(8 * MIB, "held")
        waiter = asyncio.ensure_future(budget.wait(5 * MIB, "waiting"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        held.release()
        reservation = await asyncio.wait_for(waiter, 5)
        return reservation.nbytes

    assert asyncio.run(scenario()) == 5 * MIB


def test_releasing_an_owner_releases_its_parts_of_any_budget_and_closes_them() -> None:
    budget, rings = MemoryBudget(100 * MIB), MemoryBudget(100 * MIB, bulk_share=1.0)
    call = budget.reserve(MIB, "the call's request")
    group = budget.reserve(10 * MIB, "a group of batches", owner=call)
    ring = rings.reserve(20 * MIB, "a ring", owner=call)
    group.release()  # a part released on its own leaves the owner holding the rest
    assert budget.in_use == MIB and rings.in_use == 20 * MIB
    budget.reserve(5 * MIB, "another group", owner=call)
    call.release()  # the call ended (gRPC's done-callback), whatever the stream was doing
    assert budget.in_use == 0 and rings.in_use == 0
    assert call.closed and ring.closed


def test_a_released_reservation_never_holds_bytes_again() -> None:
    budget = MemoryBudget(100 * MIB)
    call = budget.reserve(MIB, "the call's request")
    call.release()
    with pytest.raises(OverloadedError, match="its call has ended"):
        call.resize(10 * MIB, "Sample: a batch")  # engine work finishing after the call ended
    call.resize(0, "")  # shrinking is a no-op
    with pytest.raises(OverloadedError, match="its call has ended"):
        budget.reserve(MIB, "a group", owner=call)
    with pytest.raises(OverloadedError, match="its call has ended"):
        asyncio.run(budget.wait(MIB, "a group", owner=call))
    assert budget.in_use == 0


def test_room_goes_to_each_address_in_turn_however_many_calls_one_queues() -> None:
    """Ten waiters of one address and one of another: the first room that frees goes to one
    of each (before, every waiter raced for it and the crowded address took it all)."""

    async def scenario() -> list[str]:
        budget = MemoryBudget(100 * MIB, bulk_share=1.0)
        held = budget.reserve(100 * MIB, "held")
        granted: list[str] = []

        async def waiter(peer: str, i: int) -> None:
            await budget.wait(40 * MIB, f"{peer} {i}", peer=peer)
            granted.append(peer)

        tasks = [asyncio.ensure_future(waiter("ipv4:127.0.0.3", i)) for i in range(10)]
        await asyncio.sleep(0)  # the crowd queues first
        tasks.append(asyncio.ensure_future(waiter("ipv4:127.0.0.1", 0)))
        await asyncio.sleep(0.05)
        assert granted == []
        held.release()  # room for two
        while len(granted) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return granted

    assert sorted(asyncio.run(scenario())) == ["ipv4:127.0.0.1", "ipv4:127.0.0.3"]


def test_a_large_call_does_not_overtake_the_waiters_and_a_cancelled_waiter_leaves() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100 * MIB, bulk_share=1.0)
        held = budget.reserve(90 * MIB, "held")
        waiting = asyncio.ensure_future(budget.wait(30 * MIB, "waiting", peer="a"))
        gone = asyncio.ensure_future(budget.wait(30 * MIB, "gone", peer="b"))
        await asyncio.sleep(0.02)
        held.resize(40 * MIB, "held")  # 60 MiB free: enough for both, not for a third
        gone.cancel()
        with pytest.raises(OverloadedError, match="wait for room"):
            budget.reserve(5 * MIB, "a newcomer")  # the waiter is served first
        small = budget.reserve(SMALL_BYTES, "a small call")  # small calls never wait
        assert (await asyncio.wait_for(waiting, 5)).nbytes == 30 * MIB
        await asyncio.gather(gone, return_exceptions=True)
        assert budget.in_use == 70 * MIB + SMALL_BYTES and not budget._queued
        assert budget.reserve(5 * MIB, "after the waiters").nbytes == 5 * MIB  # no one waits
        small.release()

    asyncio.run(scenario())
