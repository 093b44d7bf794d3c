"""The batched F-ary sum tree against a plain reference implementation."""

from __future__ import annotations

import math

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine import sumtree
from replay_server.engine.sumtree import SumTree


class ReferenceTree:
    """The obvious O(n) implementation: a list of leaves."""

    def __init__(self, capacity: int) -> None:
        self.leaves = [0.0] * capacity

    def set(self, slots: list[int], values: list[float]) -> None:
        for slot, value in zip(slots, values):
            self.leaves[slot] = value

    def total(self) -> float:
        return sum(self.leaves)

    def min_positive(self) -> float:
        return min((v for v in self.leaves if v > 0), default=math.inf)

    def find(self, u: float) -> int:
        running = 0.0
        for slot, value in enumerate(self.leaves):
            running += value
            if running > u:
                return slot
        raise AssertionError("u beyond total")


# Multiples of 1/4 up to 8 add exactly in float32 and float64, so the tree and
# the reference agree bit for bit and every boundary is unambiguous.
_values = st.integers(0, 32).map(lambda k: k / 4)


@st.composite
def _operations(draw):
    capacity = draw(st.integers(1, 700))
    ops = draw(
        st.lists(
            st.lists(st.tuples(st.integers(0, capacity - 1), _values), min_size=1, max_size=40),
            min_size=1,
            max_size=12,
        )
    )
    return capacity, ops


# find() descends the tree for small batches and binary-searches a prefix sum
# for large ones; both must agree with the reference.
FIND_PATHS = {"descent": 0, "prefix": 10**9}


# Small trees have their top level at the blocks; shrink it to cover the binary part too.
TOP_LEVELS = {"top-1024": 1024, "top-2": 2}


# Small batches take 16-way steps (matrix products); larger ones numpy's reductions.
SMALL_BATCH = {"16-way": sumtree._SMALL_BATCH, "reductions": 0}


@pytest.mark.parametrize("small", list(SMALL_BATCH))
@pytest.mark.parametrize("top", list(TOP_LEVELS))
@pytest.mark.parametrize("path", list(FIND_PATHS))
@settings(max_examples=60, deadline=None)
@given(_operations(), st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=30))
def test_batched_tree_matches_reference(path, top, small, case, fractions):
    with mock.patch.object(sumtree, "_LARGE_BATCH", FIND_PATHS[path]), \
            mock.patch.object(sumtree, "_TOP_NODES", TOP_LEVELS[top]), \
            mock.patch.object(sumtree, "_SMALL_BATCH", SMALL_BATCH[small]), \
            mock.patch.object(sumtree, "_LANE_LOOP_MIN", 8):
        _check_against_reference(*case, fractions)


def _check_against_reference(capacity, ops, fractions):
    tree, ref = SumTree(capacity), ReferenceTree(capacity)
    for batch in ops:
        slots = [s for s, _ in batch]
        values = [v for _, v in batch]
        tree.set(torch.tensor(slots), torch.tensor(values))
        ref.set(slots, values)
        assert tree.total() == ref.total()
        assert tree.min_positive() == ref.min_positive()
        assert tree.get(torch.arange(capacity)).tolist() == ref.leaves
        if ref.total() > 0:
            # Targets on quarter boundaries exercise the exact edges of each interval.
            targets = [math.floor(f * ref.total() * 4) / 4 for f in fractions]
            found = tree.find(np.array(targets)).tolist()
            assert found == [ref.find(u) for u in targets]


@pytest.mark.parametrize("path", list(FIND_PATHS))
def test_find_always_lands_on_positive_leaf_at_the_top_of_the_range(path):
    tree = SumTree(1000)
    values = torch.rand(1000) * (torch.rand(1000) > 0.7)
    values[-50:] = 0  # trailing empty blocks
    tree.set(torch.arange(1000), values)
    just_below_total = np.full(64, math.nextafter(tree.total(), 0.0))
    with mock.patch.object(sumtree, "_LARGE_BATCH", FIND_PATHS[path]):
        found = tree.find(just_below_total)
    assert bool((tree.get(found) > 0).all())
    assert int(found[0]) == int(torch.nonzero(values)[-1])


def test_both_find_paths_agree_on_a_deep_tree():
    tree = SumTree(200_000)
    tree.set(torch.arange(200_000), torch.rand(200_000) * (torch.rand(200_000) > 0.2))
    u = np.random.default_rng(0).random(5000) * tree.total() * (1 - 1e-9)
    with mock.patch.object(sumtree, "_LARGE_BATCH", 0):
        by_descent = tree.find(u)
        by_small_steps = np.concatenate([tree.find(part) for part in np.array_split(u, 20)])
    with mock.patch.object(sumtree, "_LARGE_BATCH", 10**9):
        by_prefix = tree.find(u)
    with mock.patch.object(sumtree.workers, "MANY_CORES", True), \
            mock.patch.object(sumtree.workers, "THREADS", 3), \
            mock.patch.object(sumtree, "_PARALLEL_FIND_MIN", 1000):
        by_threads = tree.find(u)
        with mock.patch.object(sumtree, "_LARGE_BATCH", 0):
            by_threads_descent = tree.find(u)
    assert np.array_equal(by_descent, by_prefix)
    assert np.array_equal(by_small_steps, by_prefix)
    assert np.array_equal(by_threads, by_prefix)
    assert np.array_equal(by_threads_descent, by_prefix)


def test_repeated_slot_in_one_set_keeps_last_value():
    tree = SumTree(10)
    tree.set(torch.tensor([3, 5, 3, 3]), torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert tree.get(torch.tensor([3, 5])).tolist() == [8.0, 2.0]
    assert tree.total() == 10.0


def test_bulk_set_that_rebuilds_equals_incremental_set():
    values = torch.rand(5000)
    bulk, incremental = SumTree(5000), SumTree(5000)
    bulk.set(torch.arange(5000), values)  # large enough to rebuild every level
    for chunk in torch.arange(5000).split(100):
        incremental.set(chunk, values[chunk])
    assert math.isclose(bulk.total(), incremental.total(), rel_tol=1e-12)
    assert bulk.min_positive() == incremental.min_positive()
    u = np.random.default_rng(0).random(1000) * bulk.total() * (1 - 1e-9)
    assert np.array_equal(bulk.find(u), incremental.find(u))


def test_many_updates_do_not_accumulate_rounding_error():
    tree = SumTree(4096)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        slots = torch.randint(4096, (256,), generator=generator)
        tree.set(slots, torch.rand(256, generator=generator) * 1e3)
    exact = float(tree.get(np.arange(4096)).sum())
    assert math.isclose(tree.total(), exact, rel_tol=1e-12)


def test_state_dict_round_trip_rebuilds_inner_nodes():
    tree = SumTree(777)
    tree.set(torch.arange(0, 777, 3), torch.rand(259))
    copy = SumTree(777)
    copy.load_state_dict(tree.state_dict(777))
    assert copy.total() == tree.total()
    u = np.random.default_rng(0).random(100) * tree.total() * (1 - 1e-9)
    assert np.array_equal(copy.find(u), tree.find(u))


def test_clear_zeroes_everything():
    tree = SumTree(50)
    tree.set(torch.arange(50), torch.ones(50))
    tree.clear()
    assert tree.total() == 0.0
    assert tree.min_positive() == math.inf
