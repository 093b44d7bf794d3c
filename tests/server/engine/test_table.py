"""Table behaviour: ids, FIFO ring, storage layout, reset, state round trip, threads."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from replay_server import FieldSpec, Table, TableConfig
from replay_server.errors import RateLimitedError, ReplayServerError
from tests.server.engine.held import lock_held_elsewhere

KINDS = {
    "uniform": {},
    "prioritized": {},
    "slice": {"slice_len": 3},
    "prioritized_slice": {"slice_len": 3},
}


def _table(kind: str = "uniform", capacity: int = 10, seed: int | None = 0) -> Table:
    return Table(TableConfig(name="t", capacity=capacity, sampler=kind, seed=seed, **KINDS[kind]))


def _rows(start: int, n: int, episode_len: int = 5) -> dict:
    row = torch.arange(start, start + n)
    return {
        "obs": {"pixels": row.to(torch.uint8).view(n, 1, 1).expand(n, 2, 2).clone(),
                "state": row.to(torch.float32).unsqueeze(1)},
        "row": row,
        "episode": row // episode_len,
        "done": row % episode_len == episode_len - 1,
    }


def test_ids_count_insertions_and_are_never_reused():
    table = _table(capacity=4)
    assert table.insert(_rows(0, 3)).tolist() == [0, 1, 2]
    assert table.insert(_rows(3, 3)).tolist() == [3, 4, 5]
    table.reset()  # ids go on from the next multiple of the capacity: slot 0 again
    assert table.insert(_rows(6, 2)).tolist() == [8, 9]


def test_full_table_overwrites_oldest_rows_first():
    table = _table(capacity=4)
    for start in range(0, 10, 2):
        table.insert(_rows(start, 2))
    assert table.size == 4
    batch = table.sample(400)
    assert set(batch.ids.tolist()) == {6, 7, 8, 9}
    assert torch.equal(batch.data["row"], batch.ids)
    assert table.info().counters.evicted == 6


def test_insert_that_wraps_the_ring_stores_every_row_in_its_slot():
    table = _table(capacity=5)
    table.insert(_rows(0, 3))
    table.insert(_rows(3, 4))  # slots 3, 4, 0, 1
    state = table.state_dict()
    assert state["columns"]["row"].tolist() == [5, 6, 2, 3, 4]
    assert state["columns"]["obs.state"][:, 0].tolist() == [5.0, 6.0, 2.0, 3.0, 4.0]


def test_sample_returns_the_nested_structure_that_was_inserted():
    table = _table()
    table.insert(_rows(0, 5))
    batch = table.sample(7)
    assert set(batch.data) == {"obs", "row", "episode", "done"}
    assert batch.data["obs"]["pixels"].shape == (7, 2, 2)
    assert batch.data["obs"]["pixels"].dtype == torch.uint8
    assert batch.data["obs"]["state"].shape == (7, 1)
    assert batch.ids.dtype == torch.int64 and batch.weights.dtype == torch.float32
    assert batch.probabilities.dtype == torch.float64


def test_declared_schema_fixes_columns_before_the_first_insert():
    config = TableConfig(
        name="t", capacity=4, schema={"x": FieldSpec(torch.float32, (3,))}
    )
    table = Table(config)
    assert table.schema is not None and table.schema.describe() == {"x": "float32[3]"}
    table.insert({"x": torch.zeros(2, 3)})
    assert table.size == 2


def test_reset_empties_the_table_but_keeps_schema_and_counts():
    table = _table("prioritized")
    table.insert(_rows(0, 5))
    table.reset()
    info = table.info()
    assert info.size == 0 and info.schema is not None
    assert info.counters.resets == 1 and info.counters.inserted == 5


def test_info_reports_capacity_size_counters_and_sampler():
    table = _table("slice", capacity=20)
    table.insert(_rows(0, 10))
    table.sample(4)
    info = table.info()
    assert (info.name, info.sampler, info.capacity, info.size) == ("t", "slice", 20, 10)
    assert info.counters.sample_calls == 1 and info.counters.sampled == 4
    assert info.sampler_stats["slices"] == 6  # two episodes of 5 steps, 3 starts each
    assert info.pinned is False
    assert info.storage_bytes == 20 * table.schema.row_bytes


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # no code runs on load


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_restores_an_identical_table(kind):
    original = _table(kind, capacity=23)
    saved_ids = {}  # row -> id, as insert returned them
    for start in range(0, 60, 6):
        ids = original.insert(_rows(start, 6))
        saved_ids.update(zip(range(start, start + 6), ids.tolist()))
        if original.config.sampler.is_prioritized:
            original.update_priorities(ids, torch.rand(6) + 0.1)
    restored = _table(kind, capacity=23, seed=99)
    restored.load_state_dict(_round_trip(original.state_dict()))

    assert restored.info().counters == original.info().counters
    assert restored.info().sampler_stats == original.info().sampler_stats
    id_of_row = {}
    for table in (original, restored):  # both go on the same way
        new_ids = table.insert(_rows(60, 4)).tolist()
        id_of_row[table] = {**saved_ids, **dict(zip(range(60, 64), new_ids))}
    # The restored table issues its new rows ids of a new segment: never the ids the
    # original issued after the state was saved.
    assert not set(id_of_row[restored].values()) & set(range(60, 64))
    a, b = original.sample(50), restored.sample(50)
    assert torch.equal(a.data["row"], b.data["row"])  # the same rows drawn ...
    for batch, table in ((a, original), (b, restored)):  # ... each with the id it was issued
        rows = batch.data["row"].reshape(-1).tolist()
        assert batch.ids.reshape(-1).tolist() == [id_of_row[table][r] for r in rows]
    assert torch.equal(a.probabilities, b.probabilities)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(a.data["obs"]["state"], b.data["obs"]["state"])


def test_state_dict_of_a_table_never_inserted_into_loads():
    restored = _table("prioritized")
    restored.load_state_dict(_round_trip(_table("prioritized").state_dict()))
    assert restored.size == 0 and restored.schema is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_concurrent_inserts_samples_and_updates_stay_consistent(kind):
    table = _table(kind, capacity=500, seed=None)
    row_of_id = dict(zip(table.insert(_rows(0, 50)).tolist(), range(50)))
    sampled: list[tuple[torch.Tensor, torch.Tensor]] = []
    errors: list[BaseException] = []

    def actor(worker: int) -> None:
        try:
            for i in range(40):
                start = 1000 * (worker + 1) + 10 * i  # rows unique per actor
                ids = table.insert(_rows(start, 10, episode_len=10))
                row_of_id.update(zip(ids.tolist(), range(start, start + 10)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def learner() -> None:
        try:
            for _ in range(60):
                batch = table.sample(32)
                sampled.append((batch.ids, batch.data["row"]))
                if table.config.sampler.is_prioritized:
                    table.update_priorities(batch.ids.reshape(-1), torch.rand(batch.ids.numel()))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=actor, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=learner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    info = table.info()
    assert info.counters.inserted == 50 + 4 * 40 * 10
    assert info.size == 500
    # Every sampled id came with exactly the row its insert stored.
    for ids, rows in sampled:
        assert [row_of_id[i] for i in ids.reshape(-1).tolist()] == rows.reshape(-1).tolist()


def test_every_engine_error_is_typed():
    table = _table()
    with pytest.raises(ReplayServerError):
        table.sample(1)


def test_sample_into_caller_buffers_and_refuse_ones_that_do_not_fit():
    from replay_server.errors import InvalidArgumentError

    table = Table(TableConfig(name="t", capacity=100, sampler="uniform", seed=0))
    table.insert({"row": torch.arange(50), "obs": torch.arange(50).float().view(50, 1).expand(50, 3).clone()})
    layout = table.batch_layout(8)
    assert layout == {"row": (torch.int64, (8,)), "obs": (torch.float32, (8, 3))}
    out = {key: torch.empty(shape, dtype=dtype) for key, (dtype, shape) in layout.items()}
    batch = table.sample(8, out=out)
    assert batch.data["obs"].data_ptr() == out["obs"].data_ptr()
    assert torch.equal(out["row"], batch.ids) and torch.equal(out["obs"][:, 2], batch.ids.float())
    before = table.state_dict()
    with pytest.raises(InvalidArgumentError, match=r"out\['obs'\] must be a contiguous torch.float32 tensor of shape \[8, 3\]"):
        table.sample(8, out={"obs": torch.empty(8, 4)})
    after = table.state_dict()
    assert before["generator"] == after["generator"] and before["counters"] == after["counters"]


def test_a_non_blocking_update_does_nothing_while_another_call_holds_the_table():
    table = _table("prioritized")
    ids = table.insert(_rows(0, 3))
    with lock_held_elsewhere(table):
        assert table.update_priorities(ids, torch.tensor([5.0, 5.0, 5.0]), blocking=False) is None
    assert table.info().counters.priority_updates == 0  # nothing was applied
    assert table.update_priorities(ids, torch.tensor([5.0, 1.0, 1.0]), blocking=False) == 3
    assert table.info().sampler_stats["max_priority"] == 5.0


def test_a_replayed_insert_keeps_its_logged_ids_and_passes_the_rate_limiter() -> None:
    """``replay_insert`` (a write-ahead log's replay) gives the rows the ids the log names and
    does not ask the rate limiter, which admitted the insert when it was logged."""
    table = Table(TableConfig(name="t", capacity=50, min_size_to_sample=1,
                              samples_per_insert=1.0, error_buffer=2.0))
    ids = []
    for _ in range(20):  # bounded: the ratio holds inserts back after a few rows
        try:
            ids += table.insert({"x": torch.zeros(1)}).tolist()
        except RateLimitedError:
            break
    else:
        pytest.fail("the rate limiter never held an insert back")
    replayed = table.replay_insert({"x": torch.ones(2)}, None, ids[-1] + 1)
    assert replayed.tolist() == [ids[-1] + 1, ids[-1] + 2]
    assert table.size == len(ids) + 2
    with pytest.raises(RateLimitedError):
        table.insert({"x": torch.zeros(1)})  # an ordinary insert is still held back
