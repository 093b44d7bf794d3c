"""n-step sampling against a plain reference model: the list of every row inserted, in order.

Actors interleave steps of their episodes in inserts of random sizes (episode
ids reused after an end, done and truncated ends), the ring wraps, a table may
be restored mid-stream with another ``n_step`` and ``gamma``, and every
sampled transition is rebuilt by scanning the list forward (rewards compared
bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_server.engine.config import TableConfig
from replay_server.engine.table import Table
from replay_server.errors import ConfigError, SchemaMismatchError

CAPACITY = 24


def step(actor: int, episode: int, t: int, reward: float, done: bool, truncated: bool) -> dict:
    return {"obs": [actor * 1000 + t, episode], "next_obs": [actor * 1000 + t + 1, episode],
            "reward": reward, "done": done, "truncated": truncated, "episode": episode}


def columns(steps: list[dict]) -> dict:
    return {"obs": torch.tensor([s["obs"] for s in steps], dtype=torch.int32),
            "next": {"obs": torch.tensor([s["next_obs"] for s in steps], dtype=torch.int32)},
            "reward": torch.tensor([s["reward"] for s in steps], dtype=torch.float32),
            "done": torch.tensor([s["done"] for s in steps]),
            "truncated": torch.tensor([s["truncated"] for s in steps]),
            "episode": torch.tensor([s["episode"] for s in steps])}


def reference(rows: list[dict], position: int, n: int, gamma: float) -> dict:
    """The n-step transition at ``position``, by scanning ``rows`` forward."""
    window = [position]
    while len(window) < n:
        last = rows[window[-1]]
        if last["done"] or last["truncated"]:
            break
        after = [q for q in range(window[-1] + 1, len(rows))
                 if rows[q]["episode"] == last["episode"]]
        if not after:
            break
        window.append(after[0])
    discounts = gamma ** np.arange(n, dtype=np.float64)
    total = np.float64(np.float32(rows[window[0]]["reward"]))
    for k, q in enumerate(window[1:], start=1):
        total += discounts[k] * np.float32(rows[q]["reward"])
    tail = rows[window[-1]]
    return {"obs": rows[position]["obs"], "next_obs": tail["next_obs"], "done": tail["done"],
            "truncated": tail["truncated"], "reward": np.float32(total), "steps": len(window)}


actor_steps = st.lists(st.tuples(st.integers(0, 2), st.floats(-5, 5, width=32),
                                 st.sampled_from(["go", "go", "go", "done", "truncated"])),
                       min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(plan=actor_steps, chunks=st.lists(st.integers(1, 7), min_size=1, max_size=10),
       n=st.integers(2, 5), gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
       restore=st.none() | st.tuples(st.integers(0, 12), st.integers(2, 5),
                                     st.sampled_from([0.0, 0.9, 1.0])))
def test_every_sampled_transition_matches_the_reference(plan, chunks, n, gamma, restore) -> None:
    table = Table(TableConfig(name="n", capacity=CAPACITY, n_step=n, gamma=gamma, seed=1))
    episodes = {0: 0, 1: 100, 2: 200}  # actor -> its current episode id (reused after truncation)
    times = {0: 0, 1: 0, 2: 0}
    steps = []
    for actor, reward, end in plan:
        steps.append(step(actor, episodes[actor], times[actor], reward, end == "done",
                          end == "truncated"))
        times[actor] += 1
        if end == "done":
            episodes[actor] += 1
    rows: list[dict] = []
    index_of: dict[int, int] = {}  # id -> its row in rows
    at, chunk = 0, 0
    while at < len(steps):  # inserts of random sizes, each mixing actors
        if restore is not None and chunk == restore[0]:
            # a restart with another n and gamma: the windows are rebuilt from the links
            n, gamma = restore[1], restore[2]
            restored = Table(TableConfig(name="n", capacity=CAPACITY, n_step=n, gamma=gamma,
                                         seed=1))
            restored.load_state_dict(table.state_dict())
            table = restored
        size = chunks[chunk % len(chunks)]
        chunk += 1
        part = steps[at:at + size]
        ids = table.insert(columns(part)).tolist()
        index_of.update(zip(ids, range(len(rows), len(rows) + len(part))))
        rows += part
        at += size
        check_batch(table.sample(16), rows, index_of, n, gamma)


def check_batch(batch, rows: list[dict], index_of: dict[int, int], n: int, gamma: float) -> None:
    """Every transition of ``batch`` is the reference's (``index_of``: id -> row in ``rows``)."""
    for i, position in enumerate(index_of[row_id] for row_id in batch.ids.tolist()):
        assert position >= len(rows) - CAPACITY  # never an overwritten row
        want = reference(rows, position, n, gamma)
        assert batch.data["obs"][i].tolist() == want["obs"]
        assert batch.data["next"]["obs"][i].tolist() == want["next_obs"]
        assert bool(batch.data["done"][i]) == want["done"]
        assert bool(batch.data["truncated"][i]) == want["truncated"]
        got = batch.data["reward"][i].numpy()
        assert got.tobytes() == want["reward"].tobytes(), (got, want["reward"])  # -0.0 too
        assert batch.data["steps_to_next_obs"][i].item() == want["steps"]


def test_ids_weights_and_first_step_columns_are_those_of_the_plain_table() -> None:
    plain, nstep = (Table(TableConfig(name="p", capacity=128, sampler="prioritized", seed=3,
                                      n_step=n)) for n in (1, 4))
    data = columns([step(a % 2, a % 2, a, float(a), a % 9 == 8, False) for a in range(90)])
    priorities = torch.rand(90) + 0.1
    for table in (plain, nstep):
        table.insert(data, priorities)
    a, b = plain.sample(32), nstep.sample(32)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    assert torch.equal(a.probabilities, b.probabilities)
    assert torch.equal(a.data["obs"], b.data["obs"])
    assert nstep.update_priorities(b.ids, torch.ones(32)) == 32  # priorities are the first step's


def test_checkpoints_keep_the_links() -> None:
    config = TableConfig(name="n", capacity=30, n_step=3, seed=5)
    table = Table(config)
    rows = [step(a % 3, a % 3, a, 1.0, False, False) for a in range(20)]
    table.insert(columns(rows[:10]))
    restored = Table(config)
    restored.load_state_dict(table.state_dict())
    for t in (table, restored):
        t.insert(columns(rows[10:]))  # links from rows saved to rows inserted after
    assert torch.equal(table.sample(20).data["reward"], restored.sample(20).data["reward"])


@pytest.mark.parametrize("fields, named", [
    ({"n_step": 3, "sampler": "fifo"}, "has no meaning with sampler 'fifo', which hands a row out"),
    ({"n_step": 0}, "n_step must be an integer"),
    ({"n_step": 2, "gamma": 1.5}, "gamma must be"),
])
def test_bad_n_step_options_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TableConfig(name="n", capacity=8, **fields)


def test_an_insert_without_next_columns_is_refused_and_stores_nothing() -> None:
    table = Table(TableConfig(name="n", capacity=8, n_step=2))
    data = columns([step(0, 0, 0, 1.0, False, False)])
    del data["next"]
    with pytest.raises(SchemaMismatchError, match="columns under 'next'"):
        table.insert(data)
    assert table.size == 0 and table.schema is None


def test_windows_stop_at_done_and_truncated_inside_them() -> None:
    table = Table(TableConfig(name="n", capacity=64, n_step=5, gamma=0.5, seed=0))
    # actor 0: done at its step 2; actor 1: truncated at its step 1, then the same id goes on
    plan = [(0, 0, 0, False, False), (1, 7, 0, False, False), (0, 0, 1, False, False),
            (1, 7, 1, False, True), (0, 0, 2, True, False), (1, 7, 2, False, False),
            (0, 1, 0, False, False), (1, 7, 3, False, False)]
    rows = [step(a, e, t, float(t + 1), d, tr) for a, e, t, d, tr in plan]
    first = int(table.insert(columns(rows[:3]))[0])
    table.insert(columns(rows[3:]))
    batch = table.sample(200)
    seen = set()
    for i, position in enumerate((batch.ids - first).tolist()):
        want = reference(rows, position, 5, 0.5)
        seen.add((position, want["steps"]))
        assert batch.data["next"]["obs"][i].tolist() == want["next_obs"]
        assert bool(batch.data["done"][i]) == want["done"]
        assert bool(batch.data["truncated"][i]) == want["truncated"]
        assert batch.data["reward"][i].item() == want["reward"]
        assert batch.data["steps_to_next_obs"][i].item() == want["steps"]
    # actor 0's step 0 stops at the done two steps on; actor 1's step 0 at the truncation
    assert (0, 3) in seen and (1, 2) in seen and (5, 2) in seen


def test_the_ring_overwriting_an_episodes_head_leaves_its_newer_windows_whole() -> None:
    capacity, n = 16, 6
    table = Table(TableConfig(name="n", capacity=capacity, n_step=n, gamma=0.9, seed=2))
    rows: list[dict] = []
    for t in range(50):  # one long episode, one step per insert: the ring wraps three times
        row = step(0, 3, t, float(t % 7) - 3.0, False, False)
        rows.append(row)
        first = int(table.insert(columns([row]))[0]) - (len(rows) - 1)
        batch = table.sample(32)
        for i, position in enumerate((batch.ids - first).tolist()):
            assert position >= len(rows) - capacity
            want = reference(rows, position, n, 0.9)
            assert batch.data["reward"][i].item() == want["reward"]
            assert batch.data["steps_to_next_obs"][i].item() == want["steps"]
            assert batch.data["next"]["obs"][i].tolist() == want["next_obs"]
    # an episode whose every stored step was overwritten goes on: it starts afresh
    table.insert(columns([step(1, 9, t, 1.0, False, False) for t in range(capacity)]))
    table.insert(columns([step(0, 3, 50, 1.0, False, False)]))
    batch = table.sample(64)
    resumed = batch.data["obs"][:, 0] == 50
    assert bool(resumed.any())
    assert (batch.data["steps_to_next_obs"][resumed] == 1).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_rewards_of_every_float_dtype_are_summed_as_numbers(dtype, shape) -> None:
    table = Table(TableConfig(name="n", capacity=8, n_step=3, gamma=0.5, seed=0))
    data = columns([step(0, 0, t, 1.0, False, False) for t in range(4)])
    data["reward"] = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=dtype).reshape(4, *shape)
    first = int(table.insert(data)[0])
    batch = table.sample(32)
    assert batch.data["reward"].dtype == dtype and batch.data["reward"].shape == (32, *shape)
    want = {0: 1 + 1 + 1, 1: 2 + 2 + 2, 2: 4 + 4, 3: 8}
    rewards = batch.data["reward"].reshape(32).tolist()
    for position, reward in zip((batch.ids - first).tolist(), rewards):
        assert reward == want[position]


def test_a_batch_into_staging_buffers_equals_a_batch_into_new_tensors() -> None:
    tables = [Table(TableConfig(name="n", capacity=128, n_step=4, gamma=0.9, seed=7))
              for _ in range(2)]
    data = columns([step(a % 3, a % 3, a, a * 0.25, a % 11 == 10, a % 13 == 12)
                    for a in range(100)])
    for table in tables:
        table.insert(data)
    out = {key: torch.full(shape, 99, dtype=dtype)
           for key, (dtype, shape) in tables[1].batch_layout(16).items()}
    a, b = tables[0].sample(16), tables[1].sample(16, out=out)
    assert torch.equal(a.ids, b.ids)
    for key in ("obs", "reward", "done", "truncated", "steps_to_next_obs"):
        assert torch.equal(a.data[key], b.data[key]), key
        assert b.data[key].data_ptr() == out[key].data_ptr()
    assert torch.equal(a.data["next"]["obs"], b.data["next"]["obs"])


@pytest.mark.parametrize("n", [1, 3])
def test_the_wire_formula_sizes_a_batch_as_sampled(n: int) -> None:
    """``batch_nbytes`` (replay_proto, both sides) counts exactly the bytes a sample returns,
    the n-step reader's step counts included."""
    table = Table(TableConfig(name="n", capacity=CAPACITY, n_step=n, seed=2))
    table.insert(columns([step(0, 1, t, 1.0, t == 9, False) for t in range(10)]))
    batch = table.sample(6)
    assert table.batch_nbytes(6) == sum(t.nbytes for t in batch.tensors())
    assert ("steps_to_next_obs" in batch.columns) == (n > 1)
