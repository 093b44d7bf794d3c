"""The split-and-merge arithmetic of sharded sampling, against the one-table formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replay_client.sharded.merge import MassBook, merge, min_probability, shares, split
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
