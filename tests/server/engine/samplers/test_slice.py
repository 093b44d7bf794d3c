"""Slice samplers under interleaved actors, checked row by row against a reference model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server import Table, TableConfig
from replay_server.errors import EmptyTableError


@dataclass
class ReferenceEpisodes:
    """Plain model: every row ever inserted, its episode segment and step number."""

    capacity: int
    slice_len: int
    rows: list[tuple[int, int]] = field(default_factory=list)  # id -> (segment, step)
    _open: dict[int, tuple[int, int]] = field(default_factory=dict)  # episode -> (segment, next step)
    _segments: int = 0
    first_live: int = 0

    def insert(self, episodes: list[int], ends: list[bool]) -> None:
        for episode, end in zip(episodes, ends):
            if episode not in self._open:
                self._open[episode] = (self._segments, 0)
                self._segments += 1
            segment, step = self._open[episode]
            self.rows.append((segment, step))
            if end:
                del self._open[episode]
            else:
                self._open[episode] = (segment, step + 1)
        self.first_live = max(self.first_live, len(self.rows) - self.capacity)

    def reset(self) -> None:
        self.first_live = len(self.rows)
        self._open.clear()

    def valid_starts(self) -> set[int]:
        live = range(self.first_live, len(self.rows))
        by_segment: dict[int, list[int]] = {}
        for row in live:
            by_segment.setdefault(self.rows[row][0], []).append(row)
        starts = set()
        for ids in by_segment.values():
            starts.update(ids[: max(0, len(ids) - self.slice_len + 1)])
        return starts

    def check_slice(self, ids: list[int]) -> None:
        assert len(ids) == self.slice_len
        assert all(self.first_live <= i < len(self.rows) for i in ids), f"stale row in {ids}"
        segment, step = self.rows[ids[0]]
        for k, row in enumerate(ids):
            assert self.rows[row] == (segment, step + k), f"slice {ids} leaves its episode at {k}"


def _table(kind: str, capacity: int, slice_len: int, seed: int = 0) -> Table:
    return Table(
        TableConfig(name="s", capacity=capacity, sampler=kind, slice_len=slice_len, seed=seed)
    )


def _rows(first_id: int, episodes: list[int], ends: list[bool]) -> dict[str, torch.Tensor]:
    n = len(episodes)
    return {
        "row": torch.arange(first_id, first_id + n, dtype=torch.int64),
        "obs": torch.arange(first_id, first_id + n, dtype=torch.float32).unsqueeze(1).repeat(1, 2),
        "episode": torch.tensor(episodes, dtype=torch.int64),
        "done": torch.tensor(ends, dtype=torch.bool),
    }


class Actors:
    """Simulated actors: each plays episodes of random length, ids reused after ``done``."""

    def __init__(self, count: int, max_episode: int, generator: torch.Generator) -> None:
        self.generator = generator
        self.max_episode = max_episode
        self.episode = list(range(count))
        self.remaining = [self._length() for _ in range(count)]
        self.next_episode = count

    def _length(self) -> int:
        return int(torch.randint(1, self.max_episode + 1, (1,), generator=self.generator))

    def steps(self, n: int, reuse_ids: bool) -> tuple[list[int], list[bool]]:
        episodes, ends = [], []
        for _ in range(n):
            actor = int(torch.randint(len(self.episode), (1,), generator=self.generator))
            self.remaining[actor] -= 1
            done = self.remaining[actor] == 0
            episodes.append(self.episode[actor])
            ends.append(done)
            if done:
                self.remaining[actor] = self._length()
                if not reuse_ids:
                    self.episode[actor] = self.next_episode
                    self.next_episode += 1
        return episodes, ends


def _run(kind, capacity, slice_len, actors, max_episode, inserts, max_chunk, reuse_ids, seed):
    generator = torch.Generator().manual_seed(seed)
    table = _table(kind, capacity, slice_len, seed=seed)
    ref = ReferenceEpisodes(capacity, slice_len)
    sim = Actors(actors, max_episode, generator)
    for _ in range(inserts):
        n = int(torch.randint(1, max_chunk + 1, (1,), generator=generator))
        episodes, ends = sim.steps(n, reuse_ids)
        ids = table.insert(_rows(len(ref.rows), episodes, ends))
        assert ids.tolist() == list(range(len(ref.rows), len(ref.rows) + n))
        ref.insert(episodes, ends)
        expected_starts = ref.valid_starts()
        assert table.info().sampler_stats["slices"] == len(expected_starts)
        if not expected_starts:
            with pytest.raises(EmptyTableError):
                table.sample(4)
            continue
        batch = table.sample(64)
        assert batch.ids.shape == (64, slice_len)
        assert set(batch.ids[:, 0].tolist()) <= expected_starts
        for row in batch.ids.tolist():
            ref.check_slice(row)
        # The data is the rows the ids name, in order.
        assert torch.equal(batch.data["row"], batch.ids)
        assert torch.equal(batch.data["obs"][..., 0].to(torch.int64), batch.ids)
        assert batch.data["obs"].shape == (64, slice_len, 2)
    return table, ref


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(8, 120),
    slice_len=st.integers(1, 8),
    actors=st.integers(1, 8),
    max_episode=st.integers(1, 30),
    max_chunk=st.integers(1, 40),
    reuse_ids=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_slices_stay_inside_one_episode_under_interleaving(
    kind, capacity, slice_len, actors, max_episode, max_chunk, reuse_ids, seed
):
    max_chunk = min(max_chunk, capacity)
    # Enough inserts to wrap the ring many times.
    inserts = max(10, 6 * capacity // max(1, max_chunk // 2))
    _run(kind, capacity, slice_len, actors, max_episode, min(inserts, 150), max_chunk, reuse_ids, seed)


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_many_actors_long_run_wraps_ring_twenty_times(kind):
    table, ref = _run(
        kind, capacity=500, slice_len=16, actors=32, max_episode=120, inserts=400,
        max_chunk=64, reuse_ids=False, seed=7,
    )
    assert len(ref.rows) > 20 * 500


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_episodes_shorter_than_slice_len_are_never_sampled(kind):
    table = _table(kind, capacity=100, slice_len=5)
    # Episode 0 has 4 steps (too short), episode 1 has 6 (two starts).
    episodes = [0, 1, 0, 1, 0, 1, 0, 1, 1, 1]
    ends = [False, False, False, False, False, False, True, False, False, True]
    table.insert(_rows(0, episodes, ends))
    batch = table.sample(200)
    starts = set(batch.ids[:, 0].tolist())
    assert starts == {1, 3}
    assert all(row == [1, 3, 5, 7, 8] or row == [3, 5, 7, 8, 9] for row in batch.ids.tolist())


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_an_episode_continued_across_inserts_is_linked(kind):
    table = _table(kind, capacity=100, slice_len=4)
    table.insert(_rows(0, [7, 8], [False, False]))
    table.insert(_rows(2, [7, 9], [False, False]))
    table.insert(_rows(4, [7, 7], [False, True]))
    batch = table.sample(20)
    assert batch.ids.tolist() == [[0, 2, 4, 5]] * 20


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_reset_forgets_open_episodes(kind):
    table = _table(kind, capacity=100, slice_len=3)
    table.insert(_rows(0, [1, 1], [False, False]))
    table.reset()
    table.insert(_rows(2, [1], [False]))
    with pytest.raises(EmptyTableError, match="slice_len"):
        table.sample(1)
    table.insert(_rows(3, [1, 1], [False, False]))
    # After a reset ids go on from the next multiple of the capacity (positions restart at 0).
    assert table.sample(5).ids.tolist() == [[100, 101, 102]] * 5


def test_truncated_also_ends_an_episode():
    table = _table("slice", capacity=100, slice_len=2)
    table.insert(
        {
            "episode": torch.tensor([3, 3, 3, 3]),
            "done": torch.tensor([False, False, False, False]),
            "truncated": torch.tensor([False, True, False, False]),
        }
    )
    assert set(map(tuple, table.sample(100).ids.tolist())) == {(0, 1), (2, 3)}


def test_abandoned_open_episodes_are_swept_after_eviction():
    table = _table("slice", capacity=1000, slice_len=2)
    # 5000 one-step episodes that never end: each is an open episode until evicted.
    for chunk in range(50):
        episodes = list(range(chunk * 100, chunk * 100 + 100))
        table.insert(_rows(chunk * 100, episodes, [False] * 100))
    assert table.info().sampler_stats["open_episodes"] <= 2 * 1000 + 1024


def test_prioritized_slice_draws_starts_by_the_start_rows_priority():
    table = Table(
        TableConfig(
            name="ps", capacity=100, sampler="prioritized_slice", slice_len=2, alpha=1.0, seed=0
        )
    )
    table.insert(_rows(0, [0, 0, 0, 0], [False, False, False, True]))  # starts 0, 1, 2
    table.update_priorities(torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, 0.0, 3.0, 100.0]))
    batch = table.sample(20_000)
    starts = batch.ids[:, 0]
    assert not bool((starts == 1).any())
    share = float((starts == 2).to(torch.float64).mean())
    assert abs(share - 0.75) < 0.02  # row 3 is not a start: its priority carries no mass
    expected_p = torch.where(starts == 2, 0.75, 0.25).to(torch.float64)
    assert torch.allclose(batch.probabilities, expected_p)
    w = (3 * expected_p).pow(-0.4)
    assert torch.allclose(batch.weights, (w / (3 * torch.tensor(0.25)).pow(-0.4)).float())


def test_prioritized_slice_start_gets_priority_given_before_it_became_a_start():
    table = Table(
        TableConfig(name="ps", capacity=100, sampler="prioritized_slice", slice_len=3, alpha=1.0)
    )
    table.insert(_rows(0, [0, 0], [False, False]), priorities=torch.tensor([5.0, 1.0]))
    table.insert(_rows(2, [0, 0], [False, False]), priorities=torch.tensor([1.0, 1.0]))
    batch = table.sample(4000)  # starts: row 0 (priority 5), row 1 (priority 1)
    assert math.isclose(float((batch.ids[:, 0] == 0).double().mean()), 5 / 6, abs_tol=0.03)


@pytest.mark.parametrize("sampler", ["slice", "prioritized_slice"])
def test_max_times_sampled_retires_slices_by_their_start_as_reverb_counts_items(sampler) -> None:
    """A slice drawn max_times_sampled times is no longer drawn; its rows stay (other slices
    hold them), so the table's size does not change; a reload keeps the counts."""
    table = Table(TableConfig(name="s", capacity=64, sampler=sampler, slice_len=3,
                              max_times_sampled=2, seed=3))
    ids = table.insert({"x": torch.arange(10), "episode": torch.zeros(10, dtype=torch.int64)})
    starts = 8  # rows 0..7 start a slice of 3 steps of the one episode
    drawn: dict[int, int] = {}
    for step in range(2 * starts):
        if step == starts:
            reloaded = Table(table.config)
            reloaded.load_state_dict(table.state_dict())
            table = reloaded
        first = int(table.sample(1).ids[0, 0])
        drawn[first] = drawn.get(first, 0) + 1
    assert drawn == {int(i): 2 for i in ids[:starts]}  # every slice exactly twice
    with pytest.raises(EmptyTableError):
        table.sample(1)
    assert table.size == 10 and table.info().counters.retired == starts
    new = table.insert({"x": torch.arange(10, 11), "episode": torch.zeros(1, dtype=torch.int64)})
    assert table.sample(1).ids[0].tolist() == [int(ids[8]), int(ids[9]), int(new[0])]
    assert table.delete(ids[:1]) == 0  # retired already
