"""Each sampler reports the mass its draw is relative to (what a sharded client merges with)."""

from __future__ import annotations

import math

import pytest
import torch

from replay_proto.mass import SamplingMass
from replay_server.engine.config import SamplerKind, TableConfig
from replay_server.engine.table import Table


def table(sampler: SamplerKind, **kw) -> Table:
    return Table(TableConfig(name="t", capacity=8, sampler=sampler, alpha=0.5, **kw))


def test_prioritized_mass_is_the_sum_and_minimum_of_p_alpha() -> None:
    t = table(SamplerKind.PRIORITIZED)
    assert t.info().mass == SamplingMass(0.0, math.inf, 0)
    ids = t.insert({"x": torch.zeros(3)}, priorities=torch.tensor([4.0, 9.0, 0.0]))
    mass = t.info().mass
    assert (mass.total, mass.min_positive, mass.count) == pytest.approx((5.0, 2.0, 3))
    batch = t.sample(16)
    assert batch.mass == mass
    torch.testing.assert_close(batch.probabilities * mass.total,
                               torch.where(batch.ids == ids[0], 2.0, 3.0).double())


def test_uniform_mass_counts_rows_and_slice_mass_counts_slice_starts() -> None:
    u = table(SamplerKind.UNIFORM)
    u.insert({"x": torch.zeros(5)})
    assert u.sample(2).mass == SamplingMass(5.0, 1.0, 5)
    s = table(SamplerKind.SLICE, slice_len=3)
    s.insert({"episode": torch.tensor([1, 1, 1, 1, 2, 2]), "x": torch.zeros(6)})
    assert s.info().mass == SamplingMass(2.0, 1.0, 2)  # episode 1 has two starts, episode 2 none
