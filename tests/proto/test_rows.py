"""What a row is: TensorDict batch dims decide; [n_envs, T] batches keep envs' episodes apart."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from replay_proto.rows import EpisodeTracker, rows_of

E, T = 3, 5


def collector_batch(done_at: dict[int, list[int]] | None = None, *, nested_next: bool = True,
                    episode: torch.Tensor | None = None) -> TensorDict:
    """A TorchRL-collector-like batch: [E, T], step value 100 * env + t."""
    step = (100 * torch.arange(E)[:, None] + torch.arange(T)[None, :]).float()
    done = torch.zeros(E, T, 1, dtype=torch.bool)
    for env, steps in (done_at or {}).items():
        done[env, steps] = True
    td = TensorDict({"obs": step[..., None].expand(E, T, 4).clone(),
                     "done": torch.zeros(E, T, 1, dtype=torch.bool)}, batch_size=[E, T])
    if nested_next:
        td["next"] = TensorDict({"done": done, "truncated": torch.zeros_like(done),
                                 "reward": torch.ones(E, T, 1)}, batch_size=[E, T])
    else:
        td["done"] = done
    if episode is not None:
        td["episode"] = episode
    return td


def test_plain_mapping_rows_are_its_leading_dim() -> None:
    columns = rows_of({"obs": torch.zeros(E, T, 4)})
    assert columns["obs"].shape == (E, T, 4) and set(columns) == {"obs"}


def test_tensordict_with_one_batch_dim_is_that_many_rows() -> None:
    columns = rows_of(TensorDict({"obs": torch.zeros(7, 4)}, batch_size=[7]))
    assert columns["obs"].shape == (7, 4) and set(columns) == {"obs"}


def test_tensordict_without_batch_dims_is_one_row() -> None:
    columns = rows_of(TensorDict({"obs": torch.arange(4.0), "next": {"r": torch.ones(1)}}, []))
    assert columns["obs"].shape == (1, 4) and columns["next.r"].shape == (1, 1)


def test_envs_by_time_batch_is_stored_env_by_env_in_time_order() -> None:
    columns = rows_of(collector_batch())
    assert columns["obs"].shape == (E * T, 4)
    assert columns["next.reward"].shape == (E * T, 1)
    expected = torch.tensor([100.0 * e + t for e in range(E) for t in range(T)])
    assert torch.equal(columns["obs"][:, 0], expected)


def test_each_env_row_gets_its_own_episode_id() -> None:
    episodes = rows_of(collector_batch())["episode"].reshape(E, T)
    assert episodes.dtype == torch.int64
    assert (episodes == episodes[:, :1]).all()
    assert len(set(episodes[:, 0].tolist())) == E


def test_a_transition_that_ends_starts_a_new_episode_id_after_it() -> None:
    episodes = rows_of(collector_batch({1: [1, 3]}))["episode"].reshape(E, T)
    env1 = episodes[1].tolist()
    assert env1[0] == env1[1] != env1[2] == env1[3] != env1[4]
    assert len({env1[0], env1[2], env1[4]}) == 3
    assert len(set(episodes[0].tolist())) == 1  # the other envs are untouched


def test_without_next_entry_the_root_done_marks_ends() -> None:
    episodes = rows_of(collector_batch({0: [2]}, nested_next=False))["episode"].reshape(E, T)
    assert episodes[0, 2] != episodes[0, 3] and episodes[0, 1] == episodes[0, 2]


def test_root_done_is_ignored_when_the_transition_flags_exist() -> None:
    td = collector_batch()
    td["done"][0, 2] = True  # TorchRL's root done: the state before the step, not the step's end
    episodes = rows_of(td)["episode"].reshape(E, T)
    assert len(set(episodes[0].tolist())) == 1


def test_a_given_episode_key_is_kept() -> None:
    given = torch.arange(E * T).reshape(E, T)
    columns = rows_of(collector_batch(episode=given))
    assert torch.equal(columns["episode"], given.reshape(-1))


def test_fresh_ids_per_call_without_a_tracker() -> None:
    first = rows_of(collector_batch())["episode"].reshape(E, T)
    second = rows_of(collector_batch())["episode"].reshape(E, T)
    assert not set(first[:, 0].tolist()) & set(second[:, 0].tolist())


def test_tracker_continues_episodes_that_did_not_end_across_batches() -> None:
    tracker = EpisodeTracker()
    first = rows_of(collector_batch({2: [T - 1]}), tracker=tracker)["episode"].reshape(E, T)
    second = rows_of(collector_batch(), tracker=tracker)["episode"].reshape(E, T)
    assert second[0, 0] == first[0, -1] and second[1, 0] == first[1, -1]
    assert second[2, 0] != first[2, -1]  # env 2's episode ended with the first batch


def test_more_than_two_batch_dims_flatten_all_but_time_into_envs() -> None:
    td = TensorDict({"x": torch.arange(2 * 3 * 4).reshape(2, 3, 4)}, batch_size=[2, 3, 4])
    columns = rows_of(td)
    assert torch.equal(columns["x"], torch.arange(24))
    assert len(set(columns["episode"].reshape(6, 4)[:, 0].tolist())) == 6


def test_episode_key_name_is_configurable() -> None:
    columns = rows_of(collector_batch(), episode_key="traj")
    assert "traj" in columns and "episode" not in columns


@pytest.mark.parametrize("bad", [5, "rows", None])
def test_non_mappings_are_refused(bad) -> None:
    with pytest.raises(TypeError):
        rows_of(bad)


def test_the_wire_package_does_not_import_tensordict() -> None:
    import subprocess
    import sys

    code = ("import sys, replay_proto, replay_proto.rows, replay_proto.batch, "
            "replay_proto.variable_codec, replay_proto.sample_codec, replay_proto.messages; "
            "assert 'tensordict' not in sys.modules, 'tensordict was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
