"""Leases on queue tables: rows taken stay the taker's until acknowledged, expired or given back."""

from __future__ import annotations

import pytest
import torch

from replay_server.engine.config import TableConfig
from replay_server.engine.leases import LeaseRequest
from replay_server.engine.table import Table
from replay_server.errors import ConfigError, EmptyTableError, InvalidArgumentError

LONG = 3600.0


def queue(sampler: str = "fifo", capacity: int = 100, **options) -> Table:
    table = Table(TableConfig(name="q", capacity=capacity, sampler=sampler, **options))
    table.insert({"x": torch.arange(10)})
    return table


def take(table: Table, n: int, name: str, timeout: float = LONG) -> list[int]:
    return table.sample(n, lease=LeaseRequest(name, timeout)).data["x"].tolist()


def drain(table: Table) -> list[int]:
    return table.sample(table.size).data["x"].tolist() if table.size else []


def test_a_leased_sample_takes_its_rows_and_an_acknowledgement_keeps_them_gone() -> None:
    table = queue()
    assert take(table, 3, "a") == [0, 1, 2]
    assert table.size == 7
    assert table.settle_leases(acknowledge=["a"]) == 0
    assert drain(table) == list(range(3, 10))


def test_a_retry_of_a_held_lease_gets_the_same_rows() -> None:
    table = queue()
    first = table.sample(3, lease=LeaseRequest("a", LONG))
    again = table.sample(3, lease=LeaseRequest("a", LONG))
    assert torch.equal(first.ids, again.ids) and torch.equal(first.data["x"], again.data["x"])
    assert table.size == 7 and table.info().counters.sampled == 3
    assert take(table, 2, "b") == [3, 4]


@pytest.mark.parametrize(("sampler", "order"), [("fifo", list(range(10))),
                                                ("lifo", list(range(9, -1, -1)))])
def test_expired_leases_return_their_rows_to_their_place_in_the_order(sampler, order) -> None:
    table = queue(sampler)
    assert take(table, 2, "kept") == order[:2]
    assert take(table, 3, "gone", timeout=0.0) == order[2:5]
    assert table.settle_leases() == 3  # "gone" expired: its rows are back
    assert table.info().counters.returned == 3
    assert drain(table) == order[2:]
    assert table.settle_leases(acknowledge=["kept"]) == 0


def test_a_lease_given_back_returns_its_rows_at_once() -> None:
    table = queue()
    take(table, 4, "stream-batch-0")
    assert table.settle_leases(give_back=["stream-batch-0", "unknown"]) == 4
    assert table.size == 10
    assert drain(table) == list(range(10))


def test_acknowledged_or_unknown_leases_are_ignored() -> None:
    table = queue()
    take(table, 2, "a")
    assert table.settle_leases(acknowledge=["a", "a", "never"]) == 0
    assert table.settle_leases(give_back=["a"]) == 0
    assert table.size == 8


def test_a_checkpoint_saves_leased_rows_in_the_queue_and_keeps_the_lease() -> None:
    table = queue()
    take(table, 2, "acked")
    table.settle_leases(acknowledge=["acked"])
    take(table, 3, "held")
    state = table.state_dict()
    assert table.size == 5  # still leased here
    restored = Table(table.config)
    restored.load_state_dict(state)
    assert restored.size == 8  # the unacknowledged rows come back after a restore
    assert drain(restored) == list(range(2, 10))
    assert take(table, 5, "more") == [5, 6, 7, 8, 9]  # the original goes on unchanged
    assert table.settle_leases(give_back=["held"]) == 3


def test_the_rate_limiter_sees_returned_rows_as_never_taken() -> None:
    table = queue(max_size=10)
    take(table, 4, "a", timeout=0.0)
    assert table.rate_limiter.may_insert(4)
    table.settle_leases()
    assert not table.rate_limiter.may_insert(1)  # the queue is full again
    info = table.rate_limiter.info()
    assert (info.inserts, info.samples, info.deletes) == (10, 0, 0)


def test_a_retry_after_the_ring_overwrote_the_rows_is_refused_naming_it() -> None:
    table = queue(capacity=10)
    take(table, 3, "a")
    table.insert({"x": torch.arange(10, 20)})  # overwrites every slot
    with pytest.raises(InvalidArgumentError, match="overwritten"):
        take(table, 3, "a")


def test_reset_forgets_leases() -> None:
    table = queue()
    take(table, 3, "a")
    table.reset()
    table.insert({"x": torch.arange(5)})
    assert table.settle_leases(give_back=["a"]) == 0
    assert table.size == 5


def test_tables_that_do_not_consume_ignore_leases() -> None:
    table = queue("uniform")
    table.sample(4, lease=LeaseRequest("a", LONG))
    assert table.size == 10 and table.settle_leases(give_back=["a"]) == 0


def test_an_empty_queue_leases_nothing() -> None:
    table = queue()
    take(table, 10, "all")
    with pytest.raises(EmptyTableError):
        take(table, 1, "none")
    assert table.settle_leases(give_back=["none"]) == 0


def test_lease_timeout_applies_to_consuming_tables_only() -> None:
    assert TableConfig(name="q", capacity=4, sampler="fifo",
                       lease_timeout_s=5).effective_lease_timeout_s == 5.0
    assert TableConfig(name="q", capacity=4, sampler="fifo").effective_lease_timeout_s == 60.0
    with pytest.raises(ConfigError,
                       match="lease_timeout_s=5 is only used by sampler 'fifo' or 'lifo'"):
        TableConfig(name="u", capacity=4, sampler="uniform", lease_timeout_s=5)
    with pytest.raises(ConfigError, match="lease_timeout_s must be"):
        TableConfig(name="q", capacity=4, sampler="fifo", lease_timeout_s=0)


def test_a_lease_name_is_bounded() -> None:
    with pytest.raises(InvalidArgumentError, match="lease name"):
        LeaseRequest("x" * 300, 1.0)
    with pytest.raises(InvalidArgumentError, match="lease name"):
        LeaseRequest("", 1.0)


@pytest.mark.parametrize("sampler", ["fifo", "lifo"])
def test_a_lease_acknowledged_in_part_gives_back_only_the_rest(sampler) -> None:
    """A stream's group whose learner finished its first batches (Leases.acknowledge_first)."""
    table = queue(sampler)
    taken = take(table, 6, "group")
    back = table.settle_leases(acknowledge_first=("group", 4), give_back=["group"])
    assert back == 2 and table.size == 6
    assert sorted(drain(table)) == sorted(set(range(10)) - set(taken[:4]))
    assert table.info().counters.returned == 2


def test_acknowledging_a_lease_in_part_past_its_end_acknowledges_it_whole() -> None:
    table = queue()
    take(table, 3, "a")
    assert table.settle_leases(acknowledge_first=("a", 5), give_back=["a"]) == 0
    assert table.settle_leases(acknowledge_first=("unknown", 2)) == 0
    assert drain(table) == list(range(3, 10))


def test_a_lease_without_a_timeout_never_expires() -> None:
    table = queue()
    take(table, 3, "stream/0", timeout=float("inf"))
    assert table.settle_leases() == 0 and table.size == 7
    assert table.settle_leases(give_back=["stream/0"]) == 3 and table.size == 10
