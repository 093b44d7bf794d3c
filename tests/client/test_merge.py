"""The split-and-merge arithmetic of sharded sampling, against the one-table formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from replay_client.sharded.merge import (
    MassBook,
    merge,
    merge_into,
    min_probability,
    scatter_rows,
    shares,
    split,
)
from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass


def local_batch(shard: int, leaves: list[float], mass: SamplingMass, beta: float) -> SampleBatch:
    """What a prioritized shard answers for these drawn leaves (local probabilities and weights)."""
    leaf = torch.tensor(leaves, dtype=torch.float64)
    probabilities = leaf / mass.total
    weights = torch.pow(mass.min_positive / leaf, beta).to(torch.float32)
    ids = torch.arange(len(leaves), dtype=torch.int64) + (shard << 56)
    return SampleBatch.from_columns({"leaf": leaf.clone()}, ids, weights, probabilities, mass)


def test_split_draws_in_proportion_to_mass_and_never_from_an_empty_shard() -> None:
    masses = {0: SamplingMass(1.0, 1.0, 1), 1: SamplingMass(0.0, math.inf, 0),
              2: SamplingMass(9.0, 1.0, 9)}
    rng = np.random.default_rng(0)
    totals = np.zeros(3)
    for _ in range(2000):
        counts = split(100, masses, rng)
        assert sum(counts.values()) == 100 and 1 not in counts
        totals[list(counts)] += list(counts.values())
    np.testing.assert_allclose(totals / totals.sum(), [0.1, 0.0, 0.9], atol=0.005)
    with pytest.raises(ValueError, match="anything to sample"):
        split(4, {0: SamplingMass(0.0, math.inf, 0)}, rng)


def test_merge_gives_one_table_probabilities_and_weights_with_rows_kept_aligned() -> None:
    beta = 0.4
    # Shard 0: leaves 1, 3 (total 4); shard 1: leaves 0.5, 6 (total 6.5); shard 2: never drawn.
    masses = {0: SamplingMass(4.0, 1.0, 2), 1: SamplingMass(6.5, 0.5, 2),
              2: SamplingMass(2.0, 2.0, 1)}
    parts = {0: local_batch(0, [1.0, 3.0, 3.0], masses[0], beta),
             1: local_batch(1, [6.0, 0.5], masses[1], beta)}
    merged = merge(parts, shares(masses), masses, beta, np.random.default_rng(3))
    total = 4.0 + 6.5 + 2.0
    leaf = merged.columns["leaf"]
    np.testing.assert_allclose(merged.probabilities, leaf / total, rtol=1e-12)
    np.testing.assert_allclose(merged.weights, (0.5 / leaf) ** beta, rtol=1e-6)  # min over all
    assert sorted(leaf.tolist()) == [0.5, 1.0, 3.0, 3.0, 6.0]
    shard_of = (merged.ids >> 56).tolist()
    assert all(x in ((1.0, 3.0) if s == 0 else (6.0, 0.5)) for x, s in zip(leaf.tolist(), shard_of))
    assert merged.mass == SamplingMass(total, 0.5, 5)


def test_stale_masses_report_the_probability_actually_drawn_with() -> None:
    """Split by old masses (1:1); shard 1 has doubled since. Probabilities are q_s * p_local."""
    old = {0: SamplingMass(2.0, 1.0, 2), 1: SamplingMass(2.0, 1.0, 2)}
    fresh = {0: SamplingMass(2.0, 1.0, 2), 1: SamplingMass(4.0, 1.0, 3)}
    parts = {0: local_batch(0, [1.0], fresh[0], 1.0), 1: local_batch(1, [2.0], fresh[1], 1.0)}
    merged = merge(parts, shares(old), fresh, 1.0, np.random.default_rng(0))
    by_leaf = dict(zip(merged.columns["leaf"].tolist(), merged.probabilities.tolist()))
    assert by_leaf == {1.0: 0.5 * 1 / 2, 2.0: 0.5 * 2 / 4}
    assert min_probability(shares(old), fresh) == 0.5 * 1 / 4


def test_the_mass_book_forgets_per_table_and_shard() -> None:
    book = MassBook()
    book.put("t", 0, SamplingMass(1.0, 1.0, 1))
    book.put("t", 1, SamplingMass(2.0, 1.0, 2))
    book.forget("t", 0)
    assert list(book.get("t")) == [1]
    book.forget()
    assert book.get("t") == {}


def frames_batch(shard: int, first: int, rows: int, mass: SamplingMass) -> SampleBatch:
    """A shard's answer of ``rows`` Atari-like rows (small frames: 6x6x4 uint8), ids from
    ``first`` on, each row's frame filled with its id's low byte, so a row can be found
    wherever it lands."""
    ids = torch.arange(first, first + rows, dtype=torch.int64) + (shard << 56)
    frames = (ids & 0xFF).to(torch.uint8).reshape(rows, 1, 1, 1).expand(rows, 6, 6, 4)
    done = (ids % 2 == 0)
    return SampleBatch.from_columns(
        {"obs": frames.contiguous(), "done": done}, ids,
        torch.ones(rows, dtype=torch.float32), torch.full((rows,), 1.0 / mass.count,
                                                          dtype=torch.float64), mass)


class _AtenOps(TorchDispatchMode):
    """The aten operators run while active (their names)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_two_shards_rows_are_shuffled_into_the_batch_as_whole_blocks() -> None:
    """Issue 28: the merge of two shards' Atari rows placed each row with torch's
    ``index_copy_``, an element at a time (tens of ms per 7 MB batch on one core): two shards
    streamed 3-10x slower than one. Each row now lands whole, once, at its shuffled position
    (every row's frame still matches its id), and no per-element index kernel runs."""
    masses = {0: SamplingMass(4.0, 1.0, 4), 1: SamplingMass(4.0, 1.0, 4)}
    pieces = {0: [frames_batch(0, 0, 3, masses[0]), frames_batch(0, 3, 1, masses[0])],
              1: [frames_batch(1, 10, 4, masses[1])]}
    first = pieces[0][0]
    out = [torch.empty((8, *t.shape[1:]), dtype=t.dtype) for t in first.tensors()]
    with _AtenOps() as ops:
        merged = merge_into(out, list(first.columns), pieces, shares(masses), masses, None,
                            np.random.default_rng(5))
    assert not [name for name in ops.names if "index_copy" in name or "index_put" in name]
    ids = merged.ids.tolist()
    assert sorted(ids) == [0, 1, 2, 3, *[(1 << 56) + i for i in range(10, 14)]]
    assert ids != sorted(ids)  # shuffled together, not shard after shard
    for row, row_id in enumerate(ids):
        assert torch.equal(merged.columns["obs"][row],
                           torch.full((6, 6, 4), row_id & 0xFF, dtype=torch.uint8))
        assert bool(merged.columns["done"][row]) == (row_id % 2 == 0)


@pytest.mark.parametrize("dtype,shape", [
    (torch.uint8, (84, 84, 4)), (torch.bool, ()), (torch.bfloat16, (3,)), (torch.float64, (2, 2)),
    (torch.int64, ()), (torch.float32, (0,)),
])
def test_scatter_rows_writes_what_index_copy_writes(dtype: torch.dtype, shape: tuple) -> None:
    rng = np.random.default_rng(1)
    src = (torch.from_numpy(rng.random((5, *shape)) * 200).to(dtype) if dtype != torch.bool
           else torch.from_numpy(rng.random((5,)) < 0.5))
    positions = torch.from_numpy(rng.permutation(9)[:5])
    expected = torch.zeros((9, *shape), dtype=dtype).index_copy_(0, positions, src)
    dest = torch.zeros((9, *shape), dtype=dtype)
    scatter_rows(dest, positions, src)
    assert torch.equal(dest, expected)


def test_scatter_rows_takes_strided_rows_and_refuses_mismatches_as_index_copy_does() -> None:
    base = torch.arange(40, dtype=torch.int32).reshape(10, 4)
    src = base[::2, 1:3]  # strided rows
    dest = torch.zeros((6, 2), dtype=torch.int32)
    scatter_rows(dest, torch.tensor([5, 0, 3, 1, 2]), src)
    assert dest[[5, 0, 3, 1, 2]].tolist() == src.tolist() and dest[4].tolist() == [0, 0]
    with pytest.raises(RuntimeError):
        scatter_rows(dest, torch.tensor([0]), torch.zeros((1, 2), dtype=torch.float32))
    with pytest.raises(IndexError):
        scatter_rows(dest, torch.tensor([6]), torch.zeros((1, 2), dtype=torch.int32))
    assert dest[[5, 0, 3, 1, 2]].tolist() == src.tolist()  # a refused scatter wrote nothing


def test_a_piece_whose_dtype_differs_from_the_batch_is_refused_never_reinterpreted() -> None:
    """bfloat16 and int16 rows share numpy's int16 view: the host fast path compares torch
    dtypes, so such a piece goes to ``index_copy_``, which refuses it naming both."""
    masses = {0: SamplingMass(2.0, 1.0, 2), 1: SamplingMass(2.0, 1.0, 2)}

    def piece(shard: int, dtype: torch.dtype) -> SampleBatch:
        return SampleBatch.from_flat(
            {"x": torch.ones(2, 3).to(dtype)},
            [torch.arange(2) + (shard << 56), torch.ones(2), torch.full((2,), 0.5,
                                                                        dtype=torch.float64)],
            mass=masses[shard])

    pieces = {0: [piece(0, torch.bfloat16)], 1: [piece(1, torch.int16)]}
    out = [torch.zeros((4, 3), dtype=torch.bfloat16), torch.empty(4, dtype=torch.int64),
           torch.empty(4), torch.empty(4, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match="BFloat16|Short"):
        merge_into(out, ["x"], pieces, shares(masses), masses, None, np.random.default_rng(0))
