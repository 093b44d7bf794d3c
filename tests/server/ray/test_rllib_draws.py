"""Draw orders: what the algorithm sends its learners in place of rows (``learners_draw``)."""

from __future__ import annotations

import pickle

import pytest

from replay_server.ray.rllib_draws import DrawRow, DrawSpec, NotAnEpisodeError, draw_order, draw_rows

SPEC = DrawSpec(address="ray://replay/dqn", table="rllib", capacity=1000, alpha=0.6, beta=0.4,
                n_step=1, gamma=0.99, client_options={"timeout": 5.0})


def test_orders_split_like_episodes_and_travel_with_one_spec() -> None:
    rows = draw_rows(6, SPEC)
    assert [len(r) for r in rows] == [1] * 6  # one env step each: RLlib splits them so
    again = pickle.loads(pickle.dumps(rows[:4]))  # a learner's share, as Ray ships it
    assert draw_order(again) == (SPEC, 4)
    assert again[0].spec is again[3].spec  # pickled once with its rows


def test_episodes_are_no_order_and_a_mix_is_refused() -> None:
    assert draw_order([]) is None and draw_order(None) is None
    assert draw_order(["an episode"]) is None
    with pytest.raises(ValueError, match="mix draw orders with episodes"):
        draw_order([DrawRow(SPEC), "an episode"])
    other = DrawSpec(**{**SPEC.__dict__, "beta": 0.5})
    with pytest.raises(ValueError, match="several draws"):
        draw_order([DrawRow(SPEC), DrawRow(other)])


def test_an_order_used_as_an_episode_names_the_learner_class_to_set() -> None:
    row = DrawRow(SPEC)
    with pytest.raises(NotAnEpisodeError, match="learner_class=replay_server.ray."
                       "rllib_learner.ShardedDQNTorchLearner") as error:
        row.get_observations()
    assert "'get_observations'" in str(error.value)
    assert not hasattr(row, "is_done")  # an AttributeError: hasattr answers False
