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
    merge_group,
    merge_into,
    min_probability,
    scatter_rows,
    shares,
    split,
    split_more,
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


def x_piece(shard: int, x: torch.Tensor, mass: SamplingMass) -> SampleBatch:
    """A shard's piece of ``len(x)`` uniform draws whose one column ``x`` is ``x``."""
    rows = len(x)
    return SampleBatch.from_flat(
        {"x": x}, [torch.arange(rows) + (shard << 56), torch.ones(rows),
                   torch.full((rows,), 1 / rows, dtype=torch.float64)], mass=mass)


def test_a_piece_whose_dtype_differs_from_the_batch_is_refused_never_reinterpreted() -> None:
    """bfloat16 and int16 rows share numpy's int16 view: the host fast path compares torch
    dtypes, so such a piece goes to ``index_copy_``, which refuses it naming both."""
    masses = {0: SamplingMass(2.0, 1.0, 2), 1: SamplingMass(2.0, 1.0, 2)}
    pieces = {0: [x_piece(0, torch.ones(2, 3).to(torch.bfloat16), masses[0])],
              1: [x_piece(1, torch.ones(2, 3).to(torch.int16), masses[1])]}
    out = [torch.zeros((4, 3), dtype=torch.bfloat16), torch.empty(4, dtype=torch.int64),
           torch.empty(4), torch.empty(4, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match="BFloat16|Short"):
        merge_into(out, ["x"], pieces, shares(masses), masses, None, np.random.default_rng(0))


# ------------------------------------------------------------------ a pass of small batches


def prioritized_rows(shard: int, first: int, rows: int, mass: SamplingMass,
                     beta: float) -> SampleBatch:
    """``rows`` of a prioritized shard's chunk: leaf ``1 + id % 5`` (local probability and
    weight as the shard reports them), a 3-float column derived from the id."""
    ids = torch.arange(first, first + rows, dtype=torch.int64) + (shard << 56)
    leaf = (1 + (ids & 0xFFFF) % 5).double()
    return SampleBatch.from_columns(
        {"x": (ids & 0xFFFF).float().unsqueeze(1).repeat(1, 3) * torch.tensor([1.0, 2.0, 3.0]),
         "flag": (ids % 3 == 0)},
        ids, torch.pow(mass.min_positive / leaf, beta).float(), leaf / mass.total, mass)


def group_of(counts: dict[int, list[int]], masses: dict[int, SamplingMass], beta: float,
             chunk: int = 7) -> dict[int, list[SampleBatch]]:
    """Each shard's rows for a pass of ``counts``, in chunks of ``chunk`` rows (a pass's
    rows cross chunk boundaries as a shard's stream delivers them)."""
    pieces = {}
    for shard, per_batch in counts.items():
        total = sum(per_batch)
        pieces[shard] = [prioritized_rows(shard, start, min(chunk, total - start), masses[shard],
                                          beta) for start in range(0, total, chunk)]
    return pieces


def test_a_pass_merged_at_once_gives_each_batch_its_rows_probabilities_and_weights() -> None:
    """A pass of small batches merged together (issue 28's two-shard stream): batch ``b``
    holds exactly the next ``counts[s][b]`` rows of each shard, shuffled, with each row's
    columns beside its id, and the probability and weight :func:`merge_into` gives it."""
    beta = 0.6
    masses = {0: SamplingMass(30.0, 1.0, 12), 1: SamplingMass(90.0, 1.0, 40)}
    counts = {0: np.array([3, 0, 5, 4]), 1: np.array([5, 8, 3, 4])}
    pieces = group_of({s: c.tolist() for s, c in counts.items()}, masses, beta)
    first = pieces[0][0]
    q = shares(masses)

    def fresh_out() -> list[torch.Tensor]:
        return [torch.full((8, *t.shape[1:]), 7).to(t.dtype) for t in first.tensors()]

    outs = [fresh_out() for _ in range(4)]
    merged = merge_group(outs, list(first.columns), pieces, counts, q, masses, beta,
                         np.random.default_rng(1))
    taken = {0: 0, 1: 0}
    for b, batch in enumerate(merged):
        assert batch.columns["x"].data_ptr() == outs[b][0].data_ptr()  # written in place
        expected_ids = []
        for shard in (0, 1):
            expected_ids += [(shard << 56) + i for i in range(taken[shard],
                                                              taken[shard] + counts[shard][b])]
            taken[shard] += counts[shard][b]
        assert sorted(batch.ids.tolist()) == sorted(expected_ids)
        local = batch.ids & 0xFFFF
        torch.testing.assert_close(batch.columns["x"][:, 2], local.float() * 3)
        assert torch.equal(batch.columns["flag"], batch.ids % 3 == 0)
        # The reference: the same rows merged by merge_into, one batch.
        own = {s: [prioritized_rows(s, taken[s] - counts[s][b], counts[s][b], masses[s], beta)]
               for s in (0, 1) if counts[s][b]}
        ref = merge_into(fresh_out(), list(first.columns), own, q, masses, beta,
                         np.random.default_rng(2))
        by_id = dict(zip(ref.ids.tolist(), zip(ref.probabilities.tolist(), ref.weights.tolist())))
        for row_id, p, w in zip(batch.ids.tolist(), batch.probabilities.tolist(),
                                batch.weights.tolist()):
            assert p == pytest.approx(by_id[row_id][0], rel=1e-12)
            assert w == pytest.approx(by_id[row_id][1], rel=1e-6)
        assert batch.mass == ref.mass


def test_a_pass_shuffles_each_batchs_shards_together_uniformly() -> None:
    """Every position of a merged batch is equally likely to hold a row of either shard:
    a shard's rows are not left in a block (over 4,000 batches, 4 per pass)."""
    masses = {0: SamplingMass(4.0, 1.0, 4), 1: SamplingMass(4.0, 1.0, 4)}
    counts = {0: np.array([2, 2, 2, 2]), 1: np.array([6, 6, 6, 6])}
    rng = np.random.default_rng(11)
    at = np.zeros(8)
    for _ in range(1000):
        pieces = group_of({s: c.tolist() for s, c in counts.items()}, masses, 0.4)
        first = pieces[0][0]
        outs = [[torch.empty((8, *t.shape[1:]), dtype=t.dtype) for t in first.tensors()]
                for _ in range(4)]
        for batch in merge_group(outs, list(first.columns), pieces, counts, shares(masses),
                                 masses, 0.4, rng):
            at += (batch.ids >> 56).numpy() == 0
    np.testing.assert_allclose(at / 4000, 2 / 8, atol=0.03)  # shard 0 holds 2 of 8 rows


def test_a_pass_with_a_piece_of_another_dtype_is_refused_never_reinterpreted() -> None:
    """Pieces that cannot be joined as the batch's rows (a bfloat16 batch, a shard's int16
    rows: numpy views both as int16) go batch by batch to merge_into, which refuses them."""
    masses = {0: SamplingMass(2.0, 1.0, 2), 1: SamplingMass(2.0, 1.0, 2)}
    pieces = {0: [x_piece(0, torch.ones(4, 3).to(torch.bfloat16), masses[0])],
              1: [x_piece(1, torch.ones(4, 3).to(torch.int16), masses[1])]}
    outs = [[torch.zeros((4, 3), dtype=torch.bfloat16), torch.empty(4, dtype=torch.int64),
             torch.empty(4), torch.empty(4, dtype=torch.float64)] for _ in range(2)]
    with pytest.raises(RuntimeError, match="BFloat16|Short"):
        merge_group(outs, ["x"], pieces, {0: np.array([2, 2]), 1: np.array([2, 2])},
                    shares(masses), masses, None, np.random.default_rng(0))


def test_a_pass_takes_only_the_batches_every_shards_rows_cover() -> None:
    """The batches after a pass's first are split as the first is (in proportion to mass,
    each of ``batch_size`` draws), and only as many as every shard's rows cover."""
    masses = {0: SamplingMass(1.0, 1.0, 1), 2: SamplingMass(3.0, 1.0, 3)}
    rng = np.random.default_rng(4)
    pass_ = split_more(64, {0: 16, 2: 48}, masses, 7, {0: 10_000, 2: 10_000}, rng)
    assert set(pass_) == {0, 2} and len(pass_[0]) == 8
    assert pass_[0][0] == 16 and pass_[2][0] == 48
    assert ((pass_[0] + pass_[2]) == 64).all()
    share = np.mean([split_more(64, {0: 16, 2: 48}, masses, 63, {0: 10**6, 2: 10**6},
                                rng)[0][1:].mean() for _ in range(50)])
    assert share == pytest.approx(16, abs=0.5)  # a quarter of each batch's draws
    # 40 rows on shard 0, plenty on shard 2: the batches whose shard-0 rows 40 cover.
    whole = split_more(64, {0: 16, 2: 48}, masses, 7, {0: 10**6, 2: 10**6},
                       np.random.default_rng(5))
    covered = int((np.cumsum(whole[0]) <= 40).sum())
    assert 1 <= covered < 8
    short = split_more(64, {0: 16, 2: 48}, masses, 7, {0: 40, 2: 10_000},
                       np.random.default_rng(5))
    assert short[0].tolist() == whole[0][:covered].tolist()
    assert short[2].tolist() == whole[2][:covered].tolist()
    # Only the first batch's rows: a pass of one.
    assert len(split_more(64, {0: 16, 2: 48}, masses, 7, {0: 16, 2: 48}, rng)[0]) == 1


def test_a_pass_with_a_piece_of_another_row_shape_is_refused() -> None:
    """A shard whose rows have another shape than the batch's (a schema changed under the
    stream) is refused as merge_into refuses it, never joined into the batch."""
    masses = {0: SamplingMass(2.0, 1.0, 2), 1: SamplingMass(2.0, 1.0, 2)}
    outs = [[torch.zeros((4, 3)), torch.empty(4, dtype=torch.int64), torch.empty(4),
             torch.empty(4, dtype=torch.float64)] for _ in range(2)]
    for widths in ((3, 5), (5, 5)):  # one shard differs; both differ from the batch
        pieces = {s: [x_piece(s, torch.ones(4, width), masses[s])]
                  for s, width in enumerate(widths)}
        with pytest.raises(RuntimeError):
            merge_group(outs, ["x"], pieces, {0: np.array([2, 2]), 1: np.array([2, 2])},
                        shares(masses), masses, None, np.random.default_rng(0))
