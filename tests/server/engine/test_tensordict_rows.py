"""A [n_envs, T] TensorDict inserted into a slice table: slices stay inside one env's episode."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from replay_server import Table, TableConfig

E, T, L = 4, 30, 5


def collector_batch(round_: int) -> TensorDict:
    """Step value encodes (round, env, t); env e ends an episode every 7 + e steps."""
    t = torch.arange(T)[None, :].expand(E, T)
    env = torch.arange(E)[:, None].expand(E, T)
    step = 10_000 * round_ + 100 * env + t
    done = ((round_ * T + t) % (7 + env) == 6 + env)[..., None]
    return TensorDict({"step": step, "env": env,
                       "next": {"done": done, "reward": torch.ones(E, T, 1)}}, [E, T])


def test_slices_of_collector_batches_never_span_envs_or_episode_ends() -> None:
    table = Table(TableConfig(name="seq", capacity=10_000, sampler="slice", slice_len=L,
                              done_key="next.done", seed=3))
    for round_ in range(2):
        ids = table.insert(collector_batch(round_))
        assert ids.shape == (E * T,)
    batch = table.sample(512)
    step, env, done = (batch.data["step"], batch.data["env"], batch.data["next"]["done"][..., 0])
    assert (env == env[:, :1]).all(), "a slice mixes envs"
    assert (batch.data["episode"] == batch.data["episode"][:, :1]).all()
    assert (step[:, 1:] - step[:, :-1] == 1).all(), "a slice is not consecutive steps in order"
    assert not done[:, :-1].any(), "a slice runs past the end of an episode"
    # Without a tracker each insert gets fresh episode ids: no slice spans two inserts.
    assert (step[:, 0] // 10_000 == step[:, -1] // 10_000).all()


def test_envs_by_time_batch_is_n_envs_times_t_rows_in_order() -> None:
    table = Table(TableConfig(name="rows", capacity=1000, seed=1))
    ids = table.insert(collector_batch(0))
    assert ids.shape == (E * T,) and table.size == E * T
    assert table.info().schema["step"] == "int64[]"
