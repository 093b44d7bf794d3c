"""Proportional prioritized sampling: frequencies, weights, new-row priority, stale ids."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replay_server import Table, TableConfig


def _table(capacity: int = 64, alpha: float = 0.6, beta: float = 0.4, seed: int = 0) -> Table:
    return Table(
        TableConfig(
            name="per", capacity=capacity, sampler="prioritized", alpha=alpha, beta=beta, seed=seed
        )
    )


def _rows(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)}


def _probabilities(table: Table, ids: torch.Tensor) -> dict[int, float]:
    """Exact P(id) as the sampler reports it, from a large sample."""
    batch = table.sample(4096)
    return {int(i): float(p) for i, p in zip(batch.ids, batch.probabilities)}


def test_sampling_frequencies_match_priorities_to_the_alpha():
    priorities = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 8.0, 0.0, 16.0], dtype=torch.float64)
    table = _table(alpha=0.6)
    ids = table.insert(_rows(8), priorities=priorities)
    expected = priorities.pow(0.6) / priorities.pow(0.6).sum()
    draws = 200_000
    batch = table.sample(draws)
    counts = torch.bincount(batch.ids - int(ids[0]), minlength=8).to(torch.float64)
    sigma = (expected * (1 - expected) / draws).sqrt()
    deviation = ((counts / draws - expected).abs() / sigma.clamp(min=1e-12))[expected > 0]
    assert float(deviation.max()) < 5.0, (counts / draws, expected)
    assert counts[6] == 0, "a row with priority 0 must never be drawn"
    # The reported probabilities are the exact ones.
    assert torch.allclose(batch.probabilities, expected[batch.ids - int(ids[0])], rtol=1e-6)


def test_importance_weights_follow_the_formula():
    priorities = torch.tensor([0.5, 1.0, 2.0, 7.0], dtype=torch.float64)
    alpha, beta = 0.7, 0.5
    table = _table(alpha=alpha, beta=beta)
    ids = table.insert(_rows(4), priorities=priorities)
    batch = table.sample(1000)
    p = priorities.pow(alpha) / priorities.pow(alpha).sum()
    n = 4
    w = (n * p).pow(-beta)
    w = (w / w.max()).to(torch.float32)
    assert batch.weights.dtype == torch.float32
    assert torch.allclose(batch.weights, w[batch.ids - int(ids[0])], rtol=1e-5)
    assert float(batch.weights.max()) <= 1.0


def test_new_rows_get_the_largest_priority_seen_so_far():
    table = _table(alpha=1.0)
    first = table.insert(_rows(2), priorities=torch.tensor([1.0, 5.0]))
    table.update_priorities(first[:1], torch.tensor([10.0]))  # largest seen is now 10
    new = table.insert(_rows(1, start=2))
    probabilities = _probabilities(table, new)
    assert math.isclose(probabilities[int(new[0])], 10.0 / (10.0 + 5.0 + 10.0), rel_tol=1e-6)


def test_largest_priority_defaults_to_one_before_any_is_seen():
    table = _table(alpha=1.0)
    table.insert(_rows(3))
    batch = table.sample(64)
    assert torch.allclose(batch.probabilities, torch.full((64,), 1 / 3, dtype=torch.float64))
    assert table.info().sampler_stats["max_priority"] == 1.0


def test_insert_writes_each_new_rows_priority_exactly_once(monkeypatch):
    """TorchRL's issue #2211: one extend reached the sum tree by several routes."""
    table = _table()
    tree = table._parts.sampler._tree  # the one place priorities are written
    writes: list[np.ndarray] = []
    original = tree.set

    def counting_set(slots, values):
        writes.append(np.array(slots))
        original(slots, values)

    monkeypatch.setattr(tree, "set", counting_set)
    ids = table.insert(_rows(5), priorities=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert len(writes) == 1
    assert sorted(writes[0].tolist()) == sorted((ids % 64).tolist())
    leaves = tree.get(ids.numpy() % 64)
    assert np.allclose(leaves, np.array([1.0, 2.0, 3.0, 4.0, 5.0]) ** 0.6)


def test_update_of_an_overwritten_row_is_ignored_and_counted():
    table = _table(capacity=4, alpha=1.0)
    old = table.insert(_rows(4), priorities=torch.ones(4))
    new = table.insert(_rows(2, start=4), priorities=torch.ones(2))  # overwrites old[0], old[1]
    applied = table.update_priorities(old[:2], torch.tensor([1000.0, 1000.0]))
    assert applied == 0
    assert table.info().counters.stale_priority_updates == 2
    # The newer rows in those slots kept their own priority.
    probabilities = _probabilities(table, new)
    for row in new.tolist():
        assert math.isclose(probabilities[row], 0.25, rel_tol=1e-9)


def test_update_mixing_live_and_stale_ids_applies_only_the_live_ones():
    table = _table(capacity=4, alpha=1.0)
    old = table.insert(_rows(4), priorities=torch.ones(4))
    table.insert(_rows(1, start=4), priorities=torch.ones(1))  # overwrites old[0]
    applied = table.update_priorities(old[:2], torch.tensor([50.0, 3.0]))
    assert applied == 1
    probabilities = _probabilities(table, old)
    assert math.isclose(probabilities[int(old[1])], 3.0 / 6.0, rel_tol=1e-9)
    counters = table.info().counters
    assert (counters.priority_updates, counters.stale_priority_updates) == (1, 1)


def test_updates_after_reset_are_stale():
    table = _table(alpha=1.0)
    ids = table.insert(_rows(3))
    table.reset()
    assert table.update_priorities(ids, torch.ones(3)) == 0
    assert table.info().counters.stale_priority_updates == 3


def test_repeated_id_in_one_update_keeps_the_last_priority():
    table = _table(alpha=1.0)
    ids = table.insert(_rows(2), priorities=torch.ones(2))
    table.update_priorities(torch.stack([ids[0], ids[0], ids[0]]), torch.tensor([9.0, 7.0, 3.0]))
    probabilities = _probabilities(table, ids)
    assert math.isclose(probabilities[int(ids[0])], 3.0 / 4.0, rel_tol=1e-9)


@pytest.mark.parametrize("capacity", [1, 7, 300])
def test_sampled_rows_are_always_present_after_many_wraps(capacity):
    table = _table(capacity=capacity)
    generator = torch.Generator().manual_seed(1)
    inserted = 0
    for _ in range(40):
        n = int(torch.randint(1, capacity + 1, (1,), generator=generator))
        table.insert(_rows(n, start=inserted), priorities=torch.rand(n, generator=generator) + 0.01)
        inserted += n
        batch = table.sample(32)
        assert bool(((batch.ids >= inserted - table.size) & (batch.ids < inserted)).all())
        # Row data is the id itself: the gather read the right slot.
        assert torch.equal(batch.data["x"][:, 0].to(torch.int64), batch.ids)


def test_priority_mixing_gives_each_slice_start_the_mix_of_its_steps_as_r2d2_does() -> None:
    from replay_server.errors import ConfigError

    eta = 0.9
    mixed, plain = (Table(TableConfig(name="r", capacity=32, sampler="prioritized_slice",
                                      slice_len=3, seed=5, priority_mixing=m))
                    for m in (eta, None))
    rows = {"x": torch.arange(12), "episode": torch.zeros(12, dtype=torch.int64)}
    for table in (mixed, plain):
        table.insert(rows)
    batch = mixed.sample(4)
    td = torch.rand(4, 3, dtype=torch.float64)
    assert mixed.update_priorities(batch.ids, td) == 12  # every id of the 4 slices
    starts = batch.ids[:, 0]
    expected = eta * td.max(dim=1).values + (1 - eta) * td.mean(dim=1)
    plain.update_priorities(starts, expected)  # the same, applied by hand
    assert mixed.info().mass == plain.info().mass
    with pytest.raises(ConfigError, match="priority_mixing=0.9 is only used by sampler "
                                          "'prioritized_slice', and sampler is 'prioritized'"):
        TableConfig(name="r", capacity=8, sampler="prioritized", priority_mixing=0.9)


def test_priority_mixing_takes_flat_slices_as_the_wire_carries_them_and_refuses_partial_ones(
        ) -> None:
    from replay_server.errors import InvalidPriorityError

    table = Table(TableConfig(name="r", capacity=32, sampler="prioritized_slice", slice_len=3,
                              seed=5, priority_mixing=0.5))
    table.insert({"x": torch.arange(12), "episode": torch.zeros(12, dtype=torch.int64)})
    batch = table.sample(2)
    flat = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0], dtype=torch.float64)
    assert table.update_priorities(batch.ids.reshape(-1), flat) == 6
    with pytest.raises(InvalidPriorityError, match=r"slice_len=3 priorities per slice"):
        table.update_priorities(batch.ids[:, :2], flat[:4].view(2, 2))


def _episodes_table(mixing: float | None = 0.5) -> Table:
    """A mixing table of two interleaved episodes of 20 steps (ids of a slice are not
    consecutive numbers)."""
    table = Table(TableConfig(name="r", capacity=64, sampler="prioritized_slice", slice_len=4,
                              seed=3, priority_mixing=mixing))
    table.insert({"x": torch.arange(40), "episode": torch.arange(40) % 2})
    return table


@pytest.mark.parametrize("regroup", ["time-major", "steps reversed", "two halves swapped"])
def test_priority_mixing_refuses_ids_grouped_otherwise_than_the_sampled_slices(regroup) -> None:
    """A learner whose ids are not the batch's slices row by row (time-major ``[L, B]``
    flattened, steps out of order, halves of two slices) would mix the wrong steps into a
    start: refused, naming the row, and nothing is applied."""
    from replay_server.errors import InvalidPriorityError

    table = _episodes_table()
    batch = table.sample(6)
    td = torch.rand(6, 4, dtype=torch.float64)
    ids = {"time-major": batch.ids.T.reshape(-1), "steps reversed": batch.ids.flip(1),
           "two halves swapped": torch.cat([batch.ids[:, 2:], batch.ids[:, :2]], dim=1)}[regroup]
    before = table.info().mass
    with pytest.raises(InvalidPriorityError, match=r"row \d+ of the update is not a slice"):
        table.update_priorities(ids, td.reshape(ids.shape))
    assert table.info().mass == before
    assert table.update_priorities(batch.ids, td) == 24  # the same ids as sampled: applied


def test_priority_mixing_counts_a_slice_whose_start_was_overwritten_as_stale_ids() -> None:
    table = _episodes_table()
    batch = table.sample(8)
    table.insert({"x": torch.arange(40, 80), "episode": torch.arange(40, 80) % 2 + 2})
    gone = int((batch.ids[:, 0] < 80 - 64).sum())  # starts the ring overwrote
    assert 0 < gone < 8
    td = torch.rand(8, 4, dtype=torch.float64)
    assert table.update_priorities(batch.ids, td) == 4 * (8 - gone)
    assert table.info().counters.stale_priority_updates == 4 * gone
