"""Queue and stack tables against a plain reference model: a list of the rows present.

Random sequences of inserts, samples, deletes, resets and save/load through a
real :class:`Table` (small capacity, so the ring wraps and overwrites), each
batch and the table's size compared with a Python list that does the obvious
thing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine.config import TableConfig
from replay_server.engine.table import Table
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    InvalidArgumentError,
    InvalidIdsError,
    RateLimitedError,
)

CAPACITY = 8

operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(1, 5)),
        st.tuples(st.just("sample"), st.integers(1, 6)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 40), max_size=4)),
        st.tuples(st.just("reset"), st.none()),
        st.tuples(st.just("reload"), st.none()),
    ),
    max_size=40,
)


@pytest.mark.parametrize("kind", ["fifo", "lifo"])
@settings(max_examples=60, deadline=None)
@given(ops=operations, max_size=st.one_of(st.none(), st.integers(1, CAPACITY)))
def test_batches_and_sizes_match_a_reference_list(kind: str, ops: list, max_size) -> None:
    config = TableConfig(name="q", capacity=CAPACITY, sampler=kind, max_size=max_size)
    table = Table(config)
    present: list[int] = []  # positions (insertion numbers) present, oldest first
    ids_issued: list[int] = []  # the id of each position (a reload starts a new id segment)
    issued = 0
    for op, arg in ops:
        if op == "insert":
            fits = max_size is None or len(present) + arg <= max_size
            if max_size is not None and arg > max_size:
                with pytest.raises(InvalidArgumentError):
                    table.insert({"x": torch.arange(issued, issued + arg)})
                continue
            if not fits:
                with pytest.raises(RateLimitedError):
                    table.insert({"x": torch.arange(issued, issued + arg)})
                continue
            ids = table.insert({"x": torch.arange(issued, issued + arg)}).tolist()
            assert ids == list(range(ids[0], ids[0] + arg))
            ids_issued += ids
            positions = list(range(issued, issued + arg))
            issued += arg
            present = [p for p in present + positions if p >= issued - CAPACITY]  # ring overwrites
        elif op == "sample":
            if len(present) < arg:
                with pytest.raises(EmptyTableError):
                    table.sample(arg)
                continue
            batch = table.sample(arg)
            if kind == "fifo":
                taken, present = present[:arg], present[arg:]
            else:
                taken, present = present[::-1][:arg], present[: len(present) - arg]
            assert batch.ids.tolist() == [ids_issued[p] for p in taken]
            assert batch.data["x"].tolist() == taken  # the rows, not just the ids
        elif op == "delete":
            known = [p for p in arg if p < issued]
            deleted = table.delete(torch.tensor([ids_issued[p] for p in known], dtype=torch.int64))
            gone = set(known) & set(present)
            assert deleted == len(gone)
            present = [i for i in present if i not in gone]
        elif op == "reset":
            table.reset()
            present = []
        else:
            state = table.state_dict()
            table = Table(config)
            table.load_state_dict(state)
        assert table.size == len(present)
        assert table.info().sampler_stats["queue_depth"] == len(present)


def test_delete_refuses_ids_never_issued_and_tables_whose_rows_stay() -> None:
    table = Table(TableConfig(name="q", capacity=4, sampler="fifo"))
    ids = table.insert({"x": torch.arange(3)})
    with pytest.raises(InvalidIdsError):
        table.delete(torch.tensor([int(ids[-1]) + 1]))
    assert table.size == 3  # nothing removed by the refused call
    plain = Table(TableConfig(name="u", capacity=4))
    plain.insert({"x": torch.arange(3)})
    with pytest.raises(InvalidArgumentError, match="'fifo' or 'lifo', or max_times_sampled"):
        plain.delete(torch.tensor([0]))


@pytest.mark.parametrize("fields, named", [
    ({"max_size": 4}, "max_size"),                                     # rows never leave
    ({"sampler": "fifo", "max_size": 9}, "max_size"),                   # over capacity
    ({"sampler": "lifo", "samples_per_insert": 2.0}, "samples_per_insert"),  # > 1 draw a row
])
def test_bad_queue_options_are_refused_naming_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TableConfig(name="q", capacity=8, **fields)


def test_a_queue_is_an_ordered_sampler_plus_a_remover_so_flow_controls_compose() -> None:
    """min_size_to_sample, a ratio of at most one sample per row and max_times_sampled all
    mean what they mean on any table."""
    waits = Table(TableConfig(name="q", capacity=8, sampler="fifo", min_size_to_sample=3))
    waits.insert({"x": torch.arange(2)})
    with pytest.raises(RateLimitedError):
        waits.sample(1)
    waits.insert({"x": torch.arange(2, 3)})
    assert waits.sample(2).data["x"].tolist() == [0, 1]
    again = Table(TableConfig(name="t", capacity=8, sampler="fifo", max_times_sampled=2))
    again.insert({"x": torch.arange(3)})
    assert again.sample(2).data["x"].tolist() == [0, 1]
    assert again.sample(2).data["x"].tolist() == [0, 1]
    assert again.size == 1
    with pytest.raises(EmptyTableError):
        again.sample(2)
    assert again.sample(1).data["x"].tolist() == [2]
    assert again.sample(1).data["x"].tolist() == [2] and again.size == 0


def test_max_size_and_delete_work_on_any_table_whose_rows_leave_when_sampled() -> None:
    table = Table(TableConfig(name="u", capacity=8, max_times_sampled=1, max_size=3, seed=0))
    ids = table.insert({"x": torch.arange(3)})
    with pytest.raises(RateLimitedError, match="max_size=3"):
        table.insert({"x": torch.arange(1)})
    assert table.delete(ids[:1]) == 1 and table.size == 2
    table.insert({"x": torch.arange(3, 4)})
    drawn = table.sample(3).data["x"].tolist()
    assert sorted(drawn) == [1, 2, 3] and table.size == 0  # each row once, then gone


def test_a_queue_state_saved_before_queues_had_a_remover_loads() -> None:
    """The old layout kept only the runs of rows present; the rows outside them were taken."""
    config = TableConfig(name="q", capacity=4, sampler="fifo")
    table = Table(config)
    table.insert({"x": torch.arange(3)})
    table.insert({"x": torch.arange(3, 6)})  # positions 2..5 live
    table.sample(1)  # takes position 2
    state = table.state_dict()
    del state["times_sampled"]  # as saved before
    restored = Table(config)
    restored.load_state_dict(state)
    assert restored.size == 3
    assert restored.sample(3).data["x"].tolist() == [3, 4, 5]


def test_rows_taken_can_be_given_back_in_their_place_as_a_lease_expiry_would() -> None:
    """The remover keeps what a later lease needs: the removal of the rows a sample took,
    which give_back returns to the sampler (in their place in the order) with their draws."""
    table = Table(TableConfig(name="q", capacity=8, sampler="fifo"))
    table.insert({"x": torch.arange(5)})
    parts = table._parts
    index, removals = parts.remover.sample(parts.sampler, 2, parts.generator, "q",
                                           can_wait=False)
    assert index.ids.tolist() == [0, 1] and parts.size == 3
    assert parts.remover.give_back(parts.sampler, removals[0]) == 2
    assert parts.size == 5 and table.sample(5).data["x"].tolist() == [0, 1, 2, 3, 4]
