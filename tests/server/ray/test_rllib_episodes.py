"""``EpisodeWindow``: what an RLlib buffer keeps of its episodes, bounded by the rows they fill."""

from __future__ import annotations

import pytest

from replay_server.ray.rllib_episodes import EpisodeWindow


def test_it_keeps_the_episodes_of_the_last_rows_and_counts_every_one_added() -> None:
    window: EpisodeWindow[int, str] = EpisodeWindow(rows=10)
    for number in range(20):  # 20 episodes of 3 rows: the last 10 rows are in 4 of them
        assert window.add(number, f"id{number}", 3)
    assert window.added == 20
    assert len(window) == 4 and [window.get(n) for n in (16, 17, 18, 19)] == [
        "id16", "id17", "id18", "id19"]
    assert window.get(15) is None and 15 not in window


def test_a_later_chunk_renews_its_episode_and_is_not_counted_again() -> None:
    window: EpisodeWindow[str, None] = EpisodeWindow(rows=6)
    window.add("a", None, 2)
    window.add("b", None, 2)
    assert not window.add("a", None, 2)  # a's newest rows are the latest now
    window.add("c", None, 3)  # 9 rows: b (the oldest now) goes, a and c cover the last 6
    assert "b" not in window and "a" in window and "c" in window
    assert window.added == 3


def test_one_episode_longer_than_the_window_stays() -> None:
    window: EpisodeWindow[int, str] = EpisodeWindow(rows=5)
    window.add(1, "long", 50)
    assert window.get(1) == "long" and len(window) == 1


def test_state_and_restore_round_trip() -> None:
    window: EpisodeWindow[int, str] = EpisodeWindow(rows=10)
    for number in range(8):
        window.add(number, f"id{number}", 2)
    again: EpisodeWindow[int, str] = EpisodeWindow(rows=10)
    state = window.state()
    again.restore(state["episodes"], state["added"])
    assert again.state() == state and again.added == 8
    smaller: EpisodeWindow[int, str] = EpisodeWindow(rows=4)  # restored into less: bounded
    smaller.restore(state["episodes"], state["added"])
    assert len(smaller) == 2 and smaller.get(7) == "id7"


def test_a_window_of_no_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        EpisodeWindow(rows=0)
