"""Where a sharded client puts rows: episodes whole on one shard, other inserts in turn."""

from __future__ import annotations

from collections import Counter

import numpy as np

from replay_client.sharded.placement import RoundRobin, by_episode, mix


def test_every_row_of_an_episode_goes_to_one_shard_however_rows_are_batched() -> None:
    episodes = np.repeat(np.arange(50, dtype=np.int64), 7)
    np.random.default_rng(0).shuffle(episodes)
    whole = by_episode(episodes, [0, 3, 5])
    home = {}
    for shard, rows in whole.items():
        for episode in np.unique(episodes[rows]).tolist():
            assert home.setdefault(episode, shard) == shard
    assert sorted(np.concatenate(list(whole.values())).tolist()) == list(range(episodes.size))
    for part in np.array_split(episodes, 9):  # the same ids in other batches land the same
        for shard, rows in by_episode(part, [0, 3, 5]).items():
            assert {home[e] for e in part[rows].tolist()} == {shard}


def test_consecutive_episode_ids_spread_evenly() -> None:
    rows = by_episode(np.arange(3000, dtype=np.int64), [0, 1, 2, 3])
    assert all(650 <= len(r) <= 850 for r in rows.values())
    assert len(set(mix(np.arange(1000, dtype=np.int64)).tolist())) == 1000  # a bijection


def test_round_robin_takes_each_shard_in_turn() -> None:
    turns = RoundRobin()
    picked = [turns.next([1, 4, 9]) for _ in range(9)]
    assert Counter(picked) == {1: 3, 4: 3, 9: 3}
    assert len({tuple(picked[i:i + 3]) for i in (0, 3, 6)}) == 1
