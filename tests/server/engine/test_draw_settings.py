"""alpha, beta and the seed changed at run time (engine/draw_settings) on both prioritized
samplers: stored priorities keep their meaning, checkpoints keep the exponents, and the
priority bound follows the alpha in force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_server import Table, TableConfig
from replay_server.errors import InvalidArgumentError, InvalidPriorityError, NoPrioritiesError


def _per(**kw) -> Table:
    return Table(TableConfig(name="p", capacity=16, sampler="prioritized", alpha=1.0,
                             beta=0.4, seed=0, **kw))


def test_priorities_keep_their_meaning_when_alpha_changes():
    table = _per()
    ids = table.insert({"x": torch.arange(4.0)}, priorities=torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert table.set_sampling(alpha=0.5) == (0.5, 0.4)
    found = table.read_rows(ids=ids, columns=False, priorities=True)
    np.testing.assert_allclose(found.priorities, [1.0, 2.0, 4.0, 8.0], rtol=1e-5)
    batch = table.sample(4)
    # P(i) = p_i ** 0.5 / sum: the weights follow the new alpha and beta
    mass = np.array([1.0, 2.0, 4.0, 8.0]) ** 0.5
    probs = mass[batch.ids.numpy() - int(ids[0])] / mass.sum()
    np.testing.assert_allclose(batch.weights.numpy(), (mass.min() / mass.sum() / probs) ** 0.4,
                               rtol=1e-5)


def test_a_slice_table_reweights_its_starts():
    table = Table(TableConfig(name="s", capacity=16, sampler="prioritized_slice", slice_len=2,
                              alpha=1.0, beta=0.0, seed=0))
    ids = table.insert({"x": torch.arange(6.0), "episode": torch.zeros(6, dtype=torch.int64)},
                       priorities=torch.tensor([1.0, 4.0, 9.0, 16.0, 25.0, 36.0]))
    table.set_sampling(alpha=0.5)
    found = table.read_rows(ids=ids, columns=False, priorities=True)
    np.testing.assert_allclose(found.priorities, [1.0, 4.0, 9.0, 16.0, 25.0, 36.0], rtol=1e-5)
    assert table.info().sampler_stats["alpha"] == 0.5
    # starts 0..4 by sqrt(p): 1+2+3+4+5 = 15
    assert table.info().mass.total == pytest.approx(15.0, rel=1e-5)


def test_the_exponents_survive_a_checkpoint():
    table = _per()
    table.insert({"x": torch.arange(3.0)}, priorities=torch.tensor([1.0, 2.0, 3.0]))
    table.set_sampling(alpha=0.25, beta=0.9)
    restored = _per()
    restored.load_state_dict(table.state_dict())
    assert restored.info().sampler_stats["alpha"] == 0.25
    assert restored.info().sampler_stats["beta"] == 0.9


def test_inserted_priorities_are_bounded_by_the_alpha_in_force():
    table = _per()
    table.insert({"x": torch.arange(2.0)}, priorities=torch.tensor([1.0, 2.0]))
    table.set_sampling(alpha=4.0)
    # 1e20 ** 4 overflows float32's sums; under the config's alpha 1 it would not
    with pytest.raises(InvalidPriorityError, match="alpha=4.0"):
        table.insert({"x": torch.zeros(1)}, priorities=torch.tensor([1e20]))
    assert table.info().size == 2


def test_settings_a_table_cannot_take_are_refused():
    with pytest.raises(NoPrioritiesError):
        Table(TableConfig(name="u", capacity=4)).set_sampling(beta=1.0)
    table = _per()
    with pytest.raises(InvalidArgumentError, match="beta"):
        table.set_sampling(beta=-1.0)
    table.insert({"x": torch.zeros(1)}, priorities=torch.tensor([1e30]))
    with pytest.raises(InvalidArgumentError, match="overflow"):
        table.set_sampling(alpha=2.0)
    assert table.info().sampler_stats["alpha"] == 1.0
