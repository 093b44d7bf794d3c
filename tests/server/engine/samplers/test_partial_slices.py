"""Partial slices (``strict_length = false``, spans): short episodes sampled, slices cut at an
episode's ends, windows repeating their last real step; checked against a reference model."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server import Table, TableConfig
from replay_server.errors import ConfigError
from tests.server.engine.samplers.test_slice import Actors, ReferenceEpisodes, _rows

KINDS = ["slice", "prioritized_slice"]


class PartialReference(ReferenceEpisodes):
    """The reference model's episodes, with partial starts and windows."""

    def __init__(self, capacity: int, slice_len: int, strict_length: bool, span_right: int,
                 span_left: int = 0):
        super().__init__(capacity, slice_len)
        self.min_len = slice_len - span_right
        self.strict_length = strict_length
        self.span_left = span_left

    def _segments_live(self) -> list[list[int]]:
        by_segment: dict[int, list[int]] = {}
        for row in range(self.first_live, len(self.rows)):
            by_segment.setdefault(self.rows[row][0], []).append(row)
        return list(by_segment.values())

    def valid_starts(self) -> set[int]:
        starts = set()
        for ids in self._segments_live():
            starts.update(ids[: max(0, len(ids) - self.min_len + 1)])
            if not self.strict_length:
                starts.add(ids[0])
        return starts

    def window(self, start: int, cut: int = 0) -> list[int]:
        ids = next(ids for ids in self._segments_live() if start in ids)
        real = ids[ids.index(start):][: self.slice_len - cut]
        return real + [real[-1]] * (self.slice_len - len(real))

    def windows(self) -> tuple[set[tuple[int, ...]], int]:
        """Every window a draw may return, and how many draws there are."""
        starts = self.valid_starts()
        heads = [ids[0] for ids in self._segments_live() if ids[0] in starts]
        found = {tuple(self.window(start)) for start in starts}
        found |= {tuple(self.window(head, cut)) for head in heads
                  for cut in range(1, self.span_left + 1)}
        return found, len(starts) + self.span_left * len(heads)


def _table(kind: str, capacity: int, slice_len: int, seed: int = 0, **shape) -> Table:
    return Table(TableConfig(name="p", capacity=capacity, sampler=kind, slice_len=slice_len,
                             seed=seed, **shape))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None)
@given(capacity=st.integers(8, 80), slice_len=st.integers(1, 8), actors=st.integers(1, 6),
       max_episode=st.integers(1, 20), max_chunk=st.integers(1, 30), strict=st.booleans(),
       span=st.integers(0, 7), left=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_partial_slices_match_the_reference(kind, capacity, slice_len, actors, max_episode,
                                            max_chunk, strict, span, left, seed):
    span_right = min(span, slice_len - 1)
    span_left = 0 if kind == "prioritized_slice" else min(left, slice_len - 1)
    if strict and not span_right and not span_left:
        strict = False  # the strict table is test_slice's
    generator = torch.Generator().manual_seed(seed)
    table = _table(kind, capacity, slice_len, seed, strict_length=strict, span_right=span_right,
                   span_left=span_left)
    ref = PartialReference(capacity, slice_len, strict, span_right, span_left)
    sim = Actors(actors, max_episode, generator)
    max_chunk = min(max_chunk, capacity)
    for _ in range(min(120, max(10, 6 * capacity // max(1, max_chunk // 2)))):
        n = int(torch.randint(1, max_chunk + 1, (1,), generator=generator))
        episodes, ends = sim.steps(n, reuse_ids=bool(seed % 2))
        table.insert(_rows(len(ref.rows), episodes, ends))
        ref.insert(episodes, ends)
        expected = ref.valid_starts()
        info = table.info()
        assert info.sampler_stats["slices"] == len(expected)
        if not expected:
            continue
        windows, draws = ref.windows()
        assert info.mass.count == draws
        batch = table.sample(32)
        assert batch.ids.shape == (32, slice_len)
        for row in batch.ids.tolist():
            assert tuple(row) in windows
        assert torch.equal(batch.data["row"], batch.ids)


@pytest.mark.parametrize("kind", KINDS)
def test_short_episodes_are_sampled_whole_and_padded_with_their_last_step(kind):
    table = _table(kind, capacity=100, slice_len=5, strict_length=False)
    # Episode 0 has 3 steps (shorter than slice_len), episode 1 has 6 (two full starts).
    episodes = [0, 1, 0, 1, 0, 1, 1, 1, 1]
    ends = [False, False, False, False, True, False, False, False, True]
    table.insert(_rows(0, episodes, ends))
    rows = {tuple(r) for r in table.sample(300).ids.tolist()}
    assert rows == {(0, 2, 4, 4, 4), (1, 3, 5, 6, 7), (3, 5, 6, 7, 8)}


@pytest.mark.parametrize("kind", KINDS)
def test_an_open_episode_is_sampled_from_its_first_step_at_once(kind):
    table = _table(kind, capacity=100, slice_len=4, strict_length=False)
    table.insert(_rows(0, [3], [False]))
    assert table.sample(3).ids.tolist() == [[0, 0, 0, 0]] * 3
    table.insert(_rows(1, [3, 3], [False, False]))
    assert table.sample(3).ids.tolist() == [[0, 1, 2, 2]] * 3
    table.insert(_rows(3, [3], [True]))
    assert table.info().sampler_stats["slices"] == 1  # the first step counted once
    assert table.sample(3).ids.tolist() == [[0, 1, 2, 3]] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_an_episode_whose_first_steps_were_overwritten_starts_at_its_first_stored_step(kind):
    table = _table(kind, capacity=6, slice_len=5, strict_length=False)
    table.insert(_rows(0, [1, 1, 1, 1], [False, False, False, True]))
    table.insert(_rows(4, [2, 2, 2, 2], [False, False, False, False]))  # evicts rows 0 and 1
    starts = {r[0] for r in table.sample(200).ids.tolist()}
    assert starts == {2, 4}
    assert {tuple(r) for r in table.sample(200).ids.tolist()} == {(2, 3, 3, 3, 3),
                                                                  (4, 5, 6, 7, 7)}


@pytest.mark.parametrize("kind", KINDS)
def test_span_right_lets_slices_end_early(kind):
    table = _table(kind, capacity=100, slice_len=4, span_right=2)
    table.insert(_rows(0, [0] * 5, [False] * 4 + [True]))
    rows = {tuple(r) for r in table.sample(300).ids.tolist()}
    # Starts need slice_len - span_right = 2 steps; the 1-step one (row 4) is never drawn.
    assert rows == {(0, 1, 2, 3), (1, 2, 3, 4), (2, 3, 4, 4), (3, 4, 4, 4)}


def test_span_left_draws_windows_that_begin_before_an_episodes_first_step():
    table = _table("slice", capacity=100, slice_len=4, span_left=2)
    table.insert(_rows(0, [0] * 5, [False] * 4 + [True]))
    batch = table.sample(400)
    rows = {tuple(r) for r in batch.ids.tolist()}
    # Windows at offsets -2 and -1 keep 2 and 3 steps of the first one's slice.
    assert rows == {(0, 1, 2, 3), (1, 2, 3, 4), (0, 1, 1, 1), (0, 1, 2, 2)}
    assert batch.probabilities.tolist() == [0.25] * 400  # 2 starts + 2 left windows


def test_prioritized_partial_slices_update_by_the_ids_returned():
    table = _table("prioritized_slice", capacity=100, slice_len=5, strict_length=False,
                   alpha=1.0)
    table.insert(_rows(0, [0, 0, 1, 1, 1, 1, 1], [False, True] + [False] * 4 + [True]))
    batch = table.sample(50)
    short = [row for row in batch.ids.tolist() if row[0] == 0]
    assert short and short[0] == [0, 1, 1, 1, 1]
    table.update_priorities(torch.tensor([0, 2, 3]), torch.tensor([0.0, 1.0, 0.0]))
    assert {tuple(r) for r in table.sample(50).ids.tolist()} == {(2, 3, 4, 5, 6)}


@pytest.mark.parametrize("options, message", [
    ({"strict_length": "no"}, "strict_length must be true or false"),
    ({"span_right": 5}, r"span_right must be in \[0, slice_len - 1 = 4\]"),
    ({"span_left": -1}, "span_left must be an integer >= 0"),
    ({"span_right": 1.5}, "span_right must be an integer"),
])
def test_bad_slice_shapes_are_refused_naming_the_option(options, message):
    with pytest.raises(ConfigError, match=message):
        TableConfig(name="t", capacity=10, sampler="slice", slice_len=5, **options)


def test_slice_shapes_are_refused_for_row_samplers_and_left_spans_for_priorities():
    """(span_left is served by sampler 'slice' only.)"""
    with pytest.raises(ConfigError, match="strict_length=False is only used by sampler 'slice' "
                                          "or 'prioritized_slice', and sampler is 'uniform'"):
        TableConfig(name="t", capacity=10, sampler="uniform", strict_length=False)
    with pytest.raises(ConfigError, match="span_left=2 is only used by sampler 'slice', and "
                                          "sampler is 'prioritized_slice'"):
        TableConfig(name="t", capacity=10, sampler="prioritized_slice", slice_len=5,
                    span_left=2)


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind, shape", [
    ("slice", {"strict_length": False, "span_left": 2, "span_right": 1}),
    ("prioritized_slice", {"strict_length": False, "span_right": 2}),
])
def test_a_saved_partial_table_restores_its_starts_and_refuses_another_shape(kind, shape):
    original = _table(kind, capacity=30, slice_len=4, **shape)
    sim = Actors(3, 9, torch.Generator().manual_seed(3))
    for first in range(0, 70, 7):  # wraps the ring twice: heads of cut episodes move on
        original.insert(_rows(first, *sim.steps(7, reuse_ids=False)))
    state = _round_trip(original.state_dict())
    restored = _table(kind, capacity=30, slice_len=4, seed=99, **shape)
    restored.load_state_dict(state)
    assert restored.info().sampler_stats == original.info().sampler_stats
    assert restored.info().mass == original.info().mass
    a, b = original.sample(64), restored.sample(64)
    assert torch.equal(a.data["row"], b.data["row"])
    strict = _table(kind, capacity=30, slice_len=4)
    with pytest.raises(ConfigError, match="config says strict_length=True but the saved state "
                                          "has strict_length=False"):
        strict.load_state_dict(state)


def test_a_strict_slice_table_saved_before_slice_shapes_existed_still_loads():
    original = _table("slice", capacity=30, slice_len=4)
    original.insert(_rows(0, [1] * 6, [False] * 5 + [True]))
    state = _round_trip(original.state_dict())
    for key in ("strict_length", "span_left", "span_right"):
        del state["config"][key]
    restored = _table("slice", capacity=30, slice_len=4)
    restored.load_state_dict(state)
    assert restored.info().sampler_stats["slices"] == 3
    with pytest.raises(ConfigError, match="strict_length=False but the saved state has "
                                          "strict_length=True"):
        _table("slice", capacity=30, slice_len=4, strict_length=False).load_state_dict(state)
