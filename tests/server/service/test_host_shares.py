"""Per-address shares of the call pools: counts, refusals and the table's bound."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from replay_server.service.admission import Admission
from replay_server.service.budget import MemoryBudget
from replay_server.service.limits import ServiceLimits
from replay_server.service.host_shares import STREAMS, WAITING, WORKING, HostShares, share_of
from replay_server.service.status import OverloadedError


def test_a_share_is_the_floor_of_the_fraction_and_at_least_one_slot() -> None:
    assert share_of(0.75, 20) == 15
    assert share_of(0.75, 8) == 6
    assert share_of(0.29, 100) == 29  # not 28 (0.29 x 100 is 28.999... in floats)
    assert share_of(0.01, 8) == 1  # one slot at least
    assert share_of(1.0, 8) == 8
    assert share_of(0.75, 1) == 1


def test_an_address_at_its_share_is_refused_naming_itself_the_pool_and_the_setting() -> None:
    shares = HostShares(0.75, (20, 60, 8))
    for _ in range(15):
        assert shares.refusal("Sample", "ipv4:127.0.0.20", WORKING, "not run") is None
        shares.take("ipv4:127.0.0.20", WORKING)
    refusal = shares.refusal("Sample", "ipv4:127.0.0.20", WORKING, "the call was not run")
    assert isinstance(refusal, OverloadedError)
    assert ("Sample: ipv4:127.0.0.20 holds 15 of server.max_concurrent_calls = 20 working "
            "calls already (server.max_host_share = 0.75: one address may hold 15); the call "
            "was not run") in str(refusal)
    assert shares.refused == 1
    # Another address, and the same address in another pool, are not refused.
    assert shares.refusal("Sample", "ipv4:127.0.0.1", WORKING, "not run") is None
    assert shares.refusal("Sample", "ipv4:127.0.0.20", WAITING, "not run") is None
    assert shares.refused == 1


def test_each_pool_is_counted_apart_and_a_slot_given_back_admits_again() -> None:
    shares = HostShares(0.5, (8, 8, 4))
    host = "ipv6:[::1]"
    for _ in range(2):
        shares.take(host, STREAMS)
        shares.take(host, WAITING)
    assert shares.held(host) == (0, 2, 2)
    stream = shares.refusal("SampleStream", host, STREAMS, "the stream was not started")
    assert stream is not None and "server.max_streams = 4 streams" in str(stream)
    shares.give(host, STREAMS)
    assert shares.refusal("SampleStream", host, STREAMS, "not started") is None
    assert shares.held(host) == (0, 2, 1)


def test_the_table_holds_only_addresses_with_a_slot_now() -> None:
    shares = HostShares(0.75, (256, 1024, 128))
    for i in range(1000):  # addresses that come and go
        host = f"ipv4:10.0.{i // 250}.{i % 250}"
        shares.take(host, WORKING)
        shares.give(host, WORKING)
        shares.take(host, WAITING)
        shares.give(host, WAITING)
    assert shares.hosts() == 0
    shares.take("ipv4:10.0.0.1", WORKING)
    shares.take("ipv4:10.0.0.1", STREAMS)
    shares.give("ipv4:10.0.0.1", WORKING)
    assert shares.hosts() == 1  # it still holds a stream
    assert shares.held("ipv4:10.0.0.1") == (0, 0, 1)


def test_a_share_of_one_refuses_only_past_the_pool_itself() -> None:
    shares = HostShares(1.0, (4, 4, 4))
    for _ in range(4):
        assert shares.refusal("Info", "ipv4:127.0.0.1", WORKING, "not run") is None
        shares.take("ipv4:127.0.0.1", WORKING)
    assert shares.refusal("Info", "ipv4:127.0.0.1", WORKING, "not run") is not None



class _Context:
    """What admission asks of a gRPC call: its peer, its metadata, its end and its abort."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._done: list = []

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> None:
        return None

    def add_done_callback(self, callback) -> None:
        self._done.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()) -> None:
        raise _Aborted(code, details)

    def end(self) -> None:
        for callback in self._done:
            callback(self)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def _admission(**limits) -> Admission:
    made = replace(ServiceLimits.defaults(4 << 20), **limits)
    return Admission(made, MemoryBudget(made.memory_budget_bytes))


def _admit(admission: Admission, peer: str, **pool) -> _Context:
    context = _Context(peer)
    asyncio.run(admission._admit("Sample", context, 100, wait=False, **pool))
    return context


def test_admission_refuses_an_address_past_its_share_and_admits_another() -> None:
    admission = _admission(max_concurrent_calls=8, max_waiting_calls=8, max_streams=4)
    held = [_admit(admission, "ipv4:127.0.0.20:4000") for _ in range(6)]  # 0.75 x 8
    with pytest.raises(_Aborted) as caught:
        _admit(admission, "ipv4:127.0.0.20:4001")  # another port, the same address
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ipv4:127.0.0.20 holds 6 of server.max_concurrent_calls = 8" in str(caught.value)
    assert (admission.refused, admission.shares.refused) == (1, 1)
    others = [_admit(admission, "ipv4:127.0.0.1:5000") for _ in range(2)]  # the rest of the pool
    with pytest.raises(_Aborted, match="serving server.max_concurrent_calls = 8 calls"):
        _admit(admission, "ipv4:127.0.0.1:5000")  # the pool is full: the global cap says so
    for context in held + others:
        context.end()
    assert (admission.in_flight, admission.shares.hosts()) == (0, 0)
    _admit(admission, "ipv4:127.0.0.20:4002")  # its slots are free again


def test_streams_and_waiting_calls_count_against_their_address_and_are_given_back() -> None:
    admission = _admission(max_concurrent_calls=8, max_waiting_calls=8, max_streams=4)
    streams = [_admit(admission, "ipv4:127.0.0.30:1", waiting=True, stream=True)
               for _ in range(3)]
    with pytest.raises(_Aborted, match="holds 3 of server.max_streams = 4 streams already"):
        _admit(admission, "ipv4:127.0.0.30:2", waiting=True, stream=True)
    _admit(admission, "ipv4:127.0.0.31:1", waiting=True, stream=True)  # another address's
    # A unary call moving into the waiting pool is checked against its address's share too.
    working = [_admit(admission, "ipv4:127.0.0.30:3") for _ in range(4)]
    for context in working[:3]:
        admission.start_waiting(context)  # 3 streams + 3 waiters = 6 of 8: its share
    with pytest.raises(OverloadedError, match="holds 6 of server.max_waiting_calls = 8"):
        admission.start_waiting(working[3])
    assert admission.shares.held("ipv4:127.0.0.30") == (1, 6, 3)
    for context in streams + working:
        context.end()
    assert admission.shares.held("ipv4:127.0.0.30") == (0, 0, 0)
    assert (admission.in_flight, admission.waiting, admission.streams) == (0, 1, 1)
