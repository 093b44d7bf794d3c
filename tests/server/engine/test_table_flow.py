"""Flow control in a table: the rate limiter and max_times_sampled.

A call the limiter holds back raises RateLimitedError at once and changes
nothing; the limiter's counters follow inserts, evictions, samples (slices
count slice_len rows), retirements and resets, and survive state_dict. With
max_times_sampled = k no row is ever returned more than k times, retired rows
leave the size and the sampler, and a batch that cannot be completed changes
nothing. The config refuses settings that could never make progress.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine.config import TableConfig
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    RateLimitedError,
)
from replay_server.engine.table import Table
from tests.server.engine.test_table_errors import (
    KINDS,
    assert_unchanged,
    make_config,
    rows,
    snapshot,
)

ROW_KINDS = ("uniform", "prioritized")


def limiter_state(table: Table) -> tuple[int, int, int]:
    info = table.info().rate_limiter
    assert info is not None
    return info.inserts, info.samples, info.deletes


# ------------------------------------------------------------ rate limiter


@pytest.mark.parametrize("kind", KINDS)
def test_sample_below_min_size_raises_rate_limited_and_changes_nothing(kind: str) -> None:
    table = Table(make_config(kind, min_size_to_sample=6))
    table.insert(rows(kind, 5))
    before = snapshot(table)
    with pytest.raises(RateLimitedError, match=r"^table '.*': sample of \d+ rows blocked by the "
                                               r"rate limiter \(inserts=5, samples=0.*"
                                               r"min_size_to_sample=6") as info:
        table.sample(2)
    assert (info.value.table, info.value.operation) == (kind, "sample")
    assert_unchanged(table, before)
    table.insert(rows(kind, 1, first=5))
    assert table.sample(2).ids.shape[0] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_insert_ahead_of_the_ratio_raises_rate_limited_and_changes_nothing(kind: str) -> None:
    # spi=1, min size 3, error_buffer 1: window [2, 4]; inserts wait once the count passes 4.
    table = Table(make_config(kind, min_size_to_sample=3, samples_per_insert=1.0,
                              error_buffer=1.0))
    table.insert(rows(kind, 4))
    before = snapshot(table)
    with pytest.raises(RateLimitedError, match=r"insert of 1 rows blocked .*inserts=4, "
                                               r"samples=0") as info:
        table.insert(rows(kind, 1, first=4))
    assert info.value.operation == "insert"
    assert_unchanged(table, before)


def test_limiter_counts_inserts_evictions_samples_and_resets() -> None:
    table = Table(make_config("uniform", min_size_to_sample=2))
    table.insert(rows("uniform", 6))
    table.insert(rows("uniform", 5, first=6))  # capacity 8: 3 evicted
    table.sample(4)
    assert limiter_state(table) == (11, 4, 3)
    assert table.info().rate_limiter.can_sample
    table.reset()
    assert limiter_state(table) == (0, 0, 0)
    assert not table.info().rate_limiter.can_sample


@pytest.mark.parametrize("kind", ("slice", "prioritized_slice"))
def test_a_sampled_slice_counts_slice_len_rows(kind: str) -> None:
    table = Table(make_config(kind, min_size_to_sample=3))
    table.insert(rows(kind, 5))
    table.sample(4)
    assert limiter_state(table) == (5, 4 * 3, 0)


def test_table_without_a_limiter_still_counts_and_samples_an_empty_table_fails_fast() -> None:
    table = Table(make_config("uniform"))
    assert not table.info().rate_limiter.enabled
    with pytest.raises(EmptyTableError):
        table.sample(1)
    table.insert(rows("uniform", 3))
    table.sample(2)
    assert limiter_state(table) == (3, 2, 0)


def test_limiter_counters_survive_state_dict() -> None:
    config = make_config("prioritized", min_size_to_sample=2, samples_per_insert=2.0,
                         error_buffer=4.0)
    table = Table(config)
    table.insert(rows("prioritized", 5))
    table.sample(3)
    twin = Table(config)
    twin.load_state_dict(table.state_dict())
    assert limiter_state(twin) == limiter_state(table) == (5, 3, 0)


def test_state_whose_limiter_counters_do_not_fit_is_refused_and_changes_nothing() -> None:
    table = Table(make_config("uniform", min_size_to_sample=2))
    table.insert(rows("uniform", 4))
    state = table.state_dict()
    state["rate_limiter"] = {"inserts": 9, "samples": 0, "deletes": 0}
    before = snapshot(table)
    with pytest.raises(ConfigError, match="rate limiter counters inserts=9"):
        table.load_state_dict(state)
    assert_unchanged(table, before)


# ------------------------------------------------------- max_times_sampled


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_with_max_times_sampled_1_a_batch_of_every_row_returns_each_row_once(kind: str) -> None:
    table = Table(make_config(kind, max_times_sampled=1))
    table.insert(rows(kind, 8))
    batch = table.sample(8)
    assert sorted(batch.ids.tolist()) == list(range(8))
    assert torch.equal(batch.data["action"], batch.ids)
    info = table.info()
    assert (info.size, info.counters.retired) == (0, 8)
    assert limiter_state(table) == (8, 8, 8)


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_no_row_is_returned_more_than_max_times_sampled(kind: str) -> None:
    table = Table(make_config(kind, capacity=50, max_times_sampled=3))
    table.insert(rows(kind, 40), priorities=torch.rand(40) + 0.1 if kind == "prioritized" else None)
    seen: Counter[int] = Counter()
    for _ in range(40 * 3):
        left = 40 * 3 - sum(seen.values())
        if not left:
            break
        seen.update(table.sample(min(7, left)).ids.tolist())
        assert max(seen.values()) <= 3
    assert seen == Counter({i: 3 for i in range(40)})
    assert table.size == 0


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_a_retired_row_is_never_drawn_again_and_its_priority_update_is_stale(kind: str) -> None:
    table = Table(make_config(kind, max_times_sampled=1))
    table.insert(rows(kind, 4))
    first = table.sample(2).ids
    later = table.sample(2).ids
    assert not set(first.tolist()) & set(later.tolist())
    if kind == "prioritized":
        assert table.update_priorities(first, torch.full((2,), 5.0)) == 0
        assert table.info().counters.stale_priority_updates == 2


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_overwriting_retired_rows_counts_each_delete_once(kind: str) -> None:
    table = Table(make_config(kind, max_times_sampled=1))  # capacity 8
    table.insert(rows(kind, 8))
    table.sample(8)                                          # every row retires: 8 deletes
    table.insert(rows(kind, 6, first=8))                     # overwrites 6 retired rows
    info = table.info()
    assert (info.size, info.counters.evicted, info.counters.retired) == (6, 6, 8)
    assert limiter_state(table) == (14, 8, 8)


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_sample_needing_more_draws_than_left_changes_nothing(kind: str) -> None:
    table = Table(make_config(kind, max_times_sampled=2))
    table.insert(rows(kind, 3))
    before = snapshot(table)
    with pytest.raises(EmptyTableError, match=r"needs more draws than the rows stored have "
                                              r"left \(6\)"):
        table.sample(7)
    assert_unchanged(table, before)


def test_with_a_limiter_too_few_draws_left_waits_instead() -> None:
    table = Table(make_config("uniform", max_times_sampled=1, min_size_to_sample=1))
    table.insert(rows("uniform", 3))
    with pytest.raises(RateLimitedError, match="waits for inserts"):
        table.sample(4)


def test_sample_larger_than_a_full_table_can_ever_give_is_invalid() -> None:
    table = Table(make_config("uniform", max_times_sampled=2))  # capacity 8
    table.insert(rows("uniform", 8))
    with pytest.raises(InvalidArgumentError, match=r"capacity=8 rows of max_times_sampled=2 "
                                                   r"draws each allow at most 16"):
        table.sample(17)


def test_batch_that_runs_out_of_drawable_rows_is_rolled_back() -> None:
    # 2 rows with priority 0 have draws left but can never be drawn.
    table = Table(make_config("prioritized", max_times_sampled=1))
    table.insert(rows("prioritized", 5), priorities=[1.0, 2.0, 3.0, 0.0, 0.0])
    before = snapshot(table)
    with pytest.raises(EmptyTableError):
        table.sample(4)
    assert_unchanged(table, before)
    assert sorted(table.sample(3).ids.tolist()) == [0, 1, 2]


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_retirement_survives_state_dict(kind: str) -> None:
    config = make_config(kind, max_times_sampled=2)
    table = Table(config)
    table.insert(rows(kind, 6))
    table.sample(5)
    twin = Table(config)
    twin.load_state_dict(table.state_dict())
    assert (twin.size, twin.info().counters.retired) == (table.size, table.info().counters.retired)
    assert torch.equal(twin.sample(3).ids, table.sample(3).ids)


def test_state_with_another_max_times_sampled_is_refused_naming_both() -> None:
    table = Table(make_config("uniform", max_times_sampled=2))
    table.insert(rows("uniform", 3))
    state = table.state_dict()
    for other in (make_config("uniform", max_times_sampled=3), make_config("uniform")):
        with pytest.raises(ConfigError, match=r"max_times_sampled=\d but the saved state has "
                                              r"max_times_sampled=2"):
            Table(other).load_state_dict(state)


def test_state_saved_without_max_times_sampled_loads_with_every_row_drawable() -> None:
    table = Table(make_config("uniform"))
    table.insert(rows("uniform", 4))
    limited = Table(make_config("uniform", max_times_sampled=1))
    limited.load_state_dict(table.state_dict())
    assert sorted(limited.sample(4).ids.tolist()) == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None, database=None)
@given(kind=st.sampled_from(ROW_KINDS), limit=st.integers(1, 3),
       operations=st.lists(st.tuples(st.sampled_from(["insert", "sample", "update", "reset"]),
                                     st.integers(1, 10)), max_size=30))
def test_retirement_matches_a_reference_of_per_id_counts(kind: str, limit: int,
                                                         operations: list) -> None:
    """Every id is returned at most ``limit`` times, size = live ids below the limit, and
    the limiter's inserts - deletes = size, whatever the order of calls."""
    table = Table(make_config(kind, capacity=10, max_times_sampled=limit, seed=3))
    returned: Counter[int] = Counter()
    next_id = first_live = 0
    for operation, n in operations:
        if operation == "insert":
            table.insert(rows(kind, n, first=next_id))
            next_id += n
            first_live = max(first_live, next_id - 10)
        elif operation == "reset":
            table.reset()  # ids go on from the next multiple of the capacity
            next_id = first_live = -(-next_id // 10) * 10
        elif operation == "update" and kind == "prioritized" and next_id:
            ids = torch.arange(max(0, next_id - n), next_id)
            table.update_priorities(ids, torch.rand(ids.numel()) + 0.5)
        elif operation == "sample":
            try:
                batch = table.sample(n)
            except EmptyTableError:
                left = sum(limit - returned[i] for i in range(first_live, next_id))
                assert left < n
                continue
            returned.update(batch.ids.tolist())
            assert all(first_live <= i < next_id for i in batch.ids.tolist())
        live = [i for i in range(first_live, next_id) if returned[i] < limit]
        assert max(returned.values(), default=0) <= limit
        assert table.size == len(live)
        inserts, _, deletes = limiter_state(table)
        assert inserts - deletes == table.size


# ------------------------------------------------------------------ config


def config(**fields: Any) -> TableConfig:
    return TableConfig(**{"name": "t", "capacity": 100, **fields})


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"min_size_to_sample": 101}, "min_size_to_sample must be an integer in [1, capacity=100] "
                                  "(the table never holds more than capacity rows, so sampling "
                                  "would wait forever), got 101"),
    ({"min_size_to_sample": 0}, "min_size_to_sample must be an integer in [1, capacity=100]"),
    ({"min_size_to_sample": 2.5}, "got 2.5"),
    ({"samples_per_insert": 0}, "samples_per_insert must be a finite number > 0, got 0"),
    ({"samples_per_insert": float("inf")}, "samples_per_insert must be a finite number > 0"),
    ({"samples_per_insert": "8"}, "got '8'"),
    ({"error_buffer": 10.0}, "error_buffer=10.0 only applies with samples_per_insert"),
    ({"samples_per_insert": 4.0, "error_buffer": 3.0},
     "error_buffer=3.0 is below max(1, samples_per_insert=4.0) = 4.0: a single insert and a "
     "single sample could then both be blocked at once, forever"),
    ({"samples_per_insert": 0.5, "error_buffer": 0.5}, "is below max(1, samples_per_insert=0.5)"),
    ({"samples_per_insert": 1.0, "error_buffer": -1.0}, "error_buffer must be a finite number > 0"),
    ({"max_times_sampled": -1}, "max_times_sampled must be an integer in [0, 4294967295] "
                                "(0: no limit), got -1"),
    ({"max_times_sampled": True}, "got True"),
    ({"max_times_sampled": 2, "samples_per_insert": 3.0},
     "samples_per_insert=3.0 has no meaning with max_times_sampled=2"),
])
def test_flow_control_config_that_could_never_work_is_refused(fields: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        config(**fields)
    assert str(info.value).startswith("table 't': ")


def test_flow_control_config_defaults_and_describe() -> None:
    plain = config()
    assert (plain.rate_limited, plain.effective_min_size_to_sample,
            plain.effective_error_buffer, plain.max_times_sampled) == (False, 0, None, 0)
    ratio = config(samples_per_insert=2, min_size_to_sample=10)
    assert (ratio.rate_limited, ratio.samples_per_insert, ratio.effective_error_buffer) == (
        True, 2.0, 2.0 * 1000)
    described = config(min_size_to_sample=5, max_times_sampled=4).describe()
    assert (described["min_size_to_sample"], described["samples_per_insert"],
            described["error_buffer"], described["max_times_sampled"]) == (5, None, None, 4)
