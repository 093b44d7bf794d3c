"""Every bad input of DESIGN.md, through the real ReplayClient against a real server.

Each refusal must surface as the most specific ``replay_client.errors`` class (a
ReplayError), with a message naming what was wrong, and must leave the server's
tables exactly as they were: ``info()`` identical before and after, and samples
still returning the very rows that were stored (for the prioritized table, with
the probabilities the stored priorities give).

One server serves the whole module (starting a process per test would cost
seconds each); every test reads only tables no other test writes, or snapshots
them itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from replay_client import ReplayClient, ReplayError, errors
from replay_proto.keys import flatten
from tests.conftest import ServerProcess, start_server

ALPHA = 0.6
SLICE_LEN = 4
BIG_ROW = (64, 64, 4)  # uint8: 16 KiB per row
BIG_BATCH = 128  # ~2 MiB: over the 1 MiB message limit

CONFIG = f"""
[server]
max_message_mb = 1

[[tables]]
name = "uniform"
capacity = 1000
sampler = "uniform"

[[tables]]
name = "prioritized"
capacity = 1000
sampler = "prioritized"
alpha = {ALPHA}

[[tables]]
name = "slice"
capacity = 1000
sampler = "slice"
slice_len = {SLICE_LEN}

[[tables]]
name = "prioritized_slice"
capacity = 1000
sampler = "prioritized_slice"
slice_len = {SLICE_LEN}

[[tables]]
name = "declared"
capacity = 1000
sampler = "uniform"
[tables.schema]
obs = "float32[3]"
action = "int64[]"

[[tables]]
name = "short_slice"
capacity = 1000
sampler = "slice"
slice_len = {SLICE_LEN}

[[tables]]
name = "short_prioritized_slice"
capacity = 1000
sampler = "prioritized_slice"
slice_len = {SLICE_LEN}

[[tables]]
name = "fresh_slice"
capacity = 1000
sampler = "slice"
slice_len = {SLICE_LEN}

[[tables]]
name = "empty"
capacity = 1000
sampler = "uniform"

[[tables]]
name = "big"
capacity = 64
sampler = "uniform"
[tables.schema]
pixels = "uint8[{BIG_ROW[0]}, {BIG_ROW[1]}, {BIG_ROW[2]}]"

[[tables]]
name = "scratch_tensordict"
capacity = 1000

[[tables]]
name = "scratch_nested"
capacity = 1000

[[tables]]
name = "scratch_numpy"
capacity = 1000
"""

ROW_TABLES = ("uniform", "prioritized", "declared")
SLICE_TABLES = ("slice", "prioritized_slice")
SHORT_SLICE_TABLES = ("short_slice", "short_prioritized_slice")


# ------------------------------------------------------------------ fixtures


@dataclass
class Stored:
    """What a table holds: each row by id, and the priorities given at insert."""

    rows: dict[int, dict[str, torch.Tensor]]
    priorities: dict[int, float] | None = None

    def add(self, ids: torch.Tensor, columns: dict[str, torch.Tensor]) -> None:
        for i, row_id in enumerate(ids.tolist()):
            self.rows[row_id] = {key: value[i].clone() for key, value in columns.items()}


def rows(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    """``n`` rows of ``{"obs": float32[3], "action": int64[]}`` with distinct values."""
    index = torch.arange(start, start + n)
    return {"obs": (index[:, None] * 3 + torch.arange(3)).float(), "action": index * 10}


def episodes(lengths: list[int], first_episode: int, start: int) -> dict[str, torch.Tensor]:
    """Consecutive episodes of the given lengths, each ending with done=True."""
    episode = torch.cat([torch.full((n,), first_episode + k) for k, n in enumerate(lengths)])
    done = torch.cat([torch.arange(n) == n - 1 for n in lengths])
    obs = (torch.arange(start, start + len(episode))[:, None] * 3 + torch.arange(3)).float()
    return {"obs": obs, "episode": episode, "done": done}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("service_errors"), CONFIG)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stored(served: ServerProcess) -> dict[str, Stored]:
    """Fill the tables once; returns what each holds."""
    client = ReplayClient(served.address, timeout=30)
    out: dict[str, Stored] = {}
    for name in ("uniform", "declared"):
        data = rows(10, start=100 if name == "declared" else 0)
        out[name] = Stored({})
        out[name].add(client.insert(name, data), data)
    data = rows(10, start=200)
    priorities = torch.arange(1, 11, dtype=torch.float64)
    out["prioritized"] = Stored({})
    ids = client.insert("prioritized", data, priorities=priorities)
    out["prioritized"].add(ids, data)
    out["prioritized"].priorities = dict(zip(ids.tolist(), priorities.tolist()))
    for k, name in enumerate(SLICE_TABLES + SHORT_SLICE_TABLES):
        lengths = [6, 7] if name in SLICE_TABLES else [2, SLICE_LEN - 1]
        data = episodes(lengths, first_episode=10 * k, start=1000 * (k + 1))
        out[name] = Stored({})
        out[name].add(client.insert(name, data), data)
    big = {"pixels": torch.arange(32, dtype=torch.uint8)[:, None, None, None].expand(32, *BIG_ROW)}
    out["big"] = Stored({})
    out["big"].add(client.insert("big", big), big)
    client.close()
    return out


@pytest.fixture
def client(served: ServerProcess, stored: dict[str, Stored]) -> Iterator[ReplayClient]:
    with ReplayClient(served.address, timeout=30, max_retry_s=5) as c:
        yield c


@pytest.fixture
def offline_client() -> ReplayClient:
    """A client whose server does not exist: any call that reached the wire would fail
    with UnavailableError, so another error proves the client refused before sending."""
    return ReplayClient("127.0.0.1:1", timeout=2, max_retry_s=0)


# ------------------------------------------------------------------- helpers


def assert_rows_are_stored(client: ReplayClient, table: str, stored: Stored) -> None:
    """A sample of ``table`` returns exactly the stored rows for its ids."""
    batch = client.sample(table, 32)
    ids = batch.ids.reshape(-1).tolist()
    lead = batch.ids.dim()
    for key, values in flatten(batch.data).items():
        flat = values.reshape(len(ids), *values.shape[lead:])
        for i, row_id in enumerate(ids):
            assert torch.equal(flat[i], stored.rows[row_id][key]), (table, key, row_id)
    if stored.priorities is not None:
        total = sum(p**ALPHA for p in stored.priorities.values())
        expected = [stored.priorities[i] ** ALPHA / total for i in ids]
        assert batch.probabilities.tolist() == pytest.approx(expected, rel=1e-4)


@contextmanager
def unchanged(client: ReplayClient, stored: dict[str, Stored], table: str) -> Iterator[None]:
    """Every table's info is identical after the block; ``table`` still samples its rows."""
    before = client.info()
    yield
    assert client.info() == before
    if table in stored and table not in SHORT_SLICE_TABLES:  # those have nothing to sample
        assert_rows_are_stored(client, table, stored[table])


def raised(fn: Callable[[], Any]) -> ReplayError:
    with pytest.raises(ReplayError) as info:
        fn()
    return info.value


def assert_error(error: BaseException, cls: type[ReplayError], *fragments: str) -> None:
    assert type(error) is cls, f"{type(error).__name__}: {error}"
    for fragment in fragments:
        assert fragment in str(error), str(error)


def first_batch(client: ReplayClient, table: str, batch_size: int) -> Any:
    # wait=False: a stream waits for data by default (tests/integration/test_data_waits.py)
    return next(iter(client.stream(table, batch_size, num_batches=1, wait=False)))


# --------------------------------------------------------------- unknown table

UNKNOWN_TABLE_CALLS: dict[str, Callable[[ReplayClient], Any]] = {
    "insert": lambda c: c.insert("nope", rows(2)),
    "sample": lambda c: c.sample("nope", 1),
    "stream": lambda c: first_batch(c, "nope", 1),
    "update_priorities": lambda c: c.update_priorities("nope", torch.tensor([0]),
                                                       torch.tensor([1.0])),
    "reset": lambda c: c.reset("nope"),
}


@pytest.mark.parametrize("call", list(UNKNOWN_TABLE_CALLS))
def test_unknown_table_raises_unknown_table_error_naming_it(client, stored, call) -> None:
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: UNKNOWN_TABLE_CALLS[call](client))
    assert_error(error, errors.UnknownTableError, "'nope'", "uniform")


def test_unknown_table_error_is_a_replay_error(client) -> None:
    assert isinstance(raised(lambda: client.sample("nope", 1)), ReplayError)


# ------------------------------------------------------------- schema mismatch

SCHEMA_CASES: dict[str, tuple[dict[str, torch.Tensor], tuple[str, ...]]] = {
    "missing-key": ({"obs": torch.zeros(2, 3)}, ("missing", "'action'")),
    "extra-key": ({**rows(2), "extra": torch.zeros(2)}, ("unexpected", "'extra'")),
    "wrong-dtype": ({"obs": torch.zeros(2, 3, dtype=torch.float64),
                     "action": torch.zeros(2, dtype=torch.int64)},
                    ("'obs'", "float32[3]", "float64[3]")),
    "wrong-shape": ({"obs": torch.zeros(2, 4), "action": torch.zeros(2, dtype=torch.int64)},
                    ("'obs'", "float32[3]", "float32[4]")),
    "wrong-int-dtype": ({"obs": torch.zeros(2, 3), "action": torch.zeros(2, dtype=torch.int32)},
                        ("'action'", "int64[]", "int32[]")),
}


@pytest.mark.parametrize("table", ["declared", "uniform"], ids=["declared", "first-insert"])
@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_schema_mismatch_raises_schema_mismatch_error_naming_the_key(
    client, stored, table, case
) -> None:
    data, fragments = SCHEMA_CASES[case]
    with unchanged(client, stored, table):
        error = raised(lambda: client.insert(table, data))
    assert_error(error, errors.SchemaMismatchError, f"'{table}'", *fragments)


def test_slice_table_insert_without_episode_column_raises_schema_mismatch(
    client, stored
) -> None:
    with unchanged(client, stored, "fresh_slice"):
        error = raised(lambda: client.insert("fresh_slice", {"obs": torch.zeros(4, 3)}))
    assert_error(error, errors.SchemaMismatchError, "'episode'")


def test_refused_first_insert_leaves_the_schema_unset(client, stored) -> None:
    raised(lambda: client.insert("fresh_slice", {"obs": torch.zeros(4, 3)}))
    assert client.info()["fresh_slice"].schema == {}


# ------------------------------------------------------------ other bad inserts


def test_more_rows_than_capacity_raises_invalid_argument_naming_both(client, stored) -> None:
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: client.insert("uniform", rows(1001)))
    assert_error(error, errors.InvalidArgumentError, "1001 rows", "capacity of 1000")


def test_columns_with_different_row_counts_raise_invalid_argument(client, stored) -> None:
    data = {"obs": torch.zeros(3, 3), "action": torch.zeros(2, dtype=torch.int64)}
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: client.insert("uniform", data))
    assert_error(error, errors.InvalidArgumentError, "different numbers of rows", "'obs': 3",
                 "'action': 2")


def test_scalar_column_raises_invalid_argument_naming_the_key(client, stored) -> None:
    data = {"obs": torch.zeros(3), "action": torch.tensor(5)}
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: client.insert("uniform", data))
    assert_error(error, errors.InvalidArgumentError, "'action'", "scalar")


def test_insert_over_the_message_limit_raises_message_too_large(client, stored, served,
                                                                monkeypatch) -> None:
    """As from another host: a same-host client's large insert goes through a shared-memory
    region, where no message limit applies (tests/integration/test_insert_regions.py)."""
    monkeypatch.setenv("REPLAY_SHARED_MEMORY", "0")
    data = {"pixels": torch.zeros(80, *BIG_ROW, dtype=torch.uint8)}  # 1.25 MiB
    with ReplayClient(served.address) as remote, unchanged(client, stored, "big"):
        error = raised(lambda: remote.insert("big", data))
    assert_error(error, errors.MessageTooLargeError, "larger than max")


def test_zero_row_insert_returns_no_ids_and_stores_nothing(client, stored) -> None:
    with unchanged(client, stored, "uniform"):
        ids = client.insert("uniform", rows(0))
    assert ids.shape == (0,)


# ------------------------------------------------------------ insert priorities


def test_priorities_on_a_uniform_table_raise_no_priorities_error(client, stored) -> None:
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: client.insert("uniform", rows(2), priorities=torch.ones(2)))
    assert_error(error, errors.NoPrioritiesError, "'uniform'", "no priorities")


@pytest.mark.parametrize(("value", "shown"), [(-1.0, "-1.0"), (math.nan, "nan"),
                                              (math.inf, "inf"), (-math.inf, "-inf")],
                         ids=["negative", "nan", "inf", "minus-inf"])
def test_bad_insert_priority_raises_invalid_priority_naming_it(
    client, stored, value, shown
) -> None:
    priorities = torch.tensor([1.0, value, 2.0], dtype=torch.float64)
    with unchanged(client, stored, "prioritized"):
        error = raised(lambda: client.insert("prioritized", rows(3), priorities=priorities))
    assert_error(error, errors.InvalidPriorityError, "finite and >= 0", "index 1", shown)


@pytest.mark.parametrize("count", [2, 4], ids=["too-few", "too-many"])
def test_wrong_number_of_insert_priorities_raises_invalid_priority(client, stored, count) -> None:
    with unchanged(client, stored, "prioritized"):
        error = raised(lambda: client.insert("prioritized", rows(3),
                                             priorities=torch.ones(count)))
    assert_error(error, errors.InvalidPriorityError, "priorities")


# ----------------------------------------------------------- update_priorities


def test_non_int64_ids_raise_invalid_ids_before_sending(offline_client) -> None:
    error = raised(lambda: offline_client.update_priorities(
        "prioritized", torch.tensor([0, 1], dtype=torch.int32), torch.ones(2)))
    assert_error(error, errors.InvalidIdsError, "int64", "int32")


def test_float_ids_raise_invalid_ids_before_sending(offline_client) -> None:
    error = raised(lambda: offline_client.update_priorities(
        "prioritized", np.array([0.0, 1.0]), np.ones(2)))
    assert_error(error, errors.InvalidIdsError, "int64", "float64")


def test_priorities_shaped_unlike_ids_raise_invalid_priority_before_sending(
    offline_client,
) -> None:
    error = raised(lambda: offline_client.update_priorities(
        "prioritized", torch.tensor([0, 1, 2]), torch.ones(2)))
    assert_error(error, errors.InvalidPriorityError, "[3]", "[2]")


def test_never_issued_id_raises_invalid_ids_naming_it(client, stored) -> None:
    issued = list(stored["prioritized"].rows)
    bad_id = max(issued) + 10**9  # the current id segment's, far past what it has issued
    ids = torch.tensor([*issued[:2], bad_id])
    with unchanged(client, stored, "prioritized"):
        error = raised(lambda: client.update_priorities("prioritized", ids, torch.ones(3)))
    assert_error(error, errors.InvalidIdsError, f"id {bad_id}", "never issued")


@pytest.mark.parametrize(("bad_id", "fragments"), [
    (-1, ["-1 is not an id"]),
    ((5 << 56) | 7, [f"id {(5 << 56) | 7} belongs to shard 5", "this server is shard 0"]),
], ids=["negative", "other-shard"])
def test_an_id_that_is_no_id_of_this_server_raises_invalid_ids(
    client, stored, bad_id, fragments
) -> None:
    ids = torch.tensor([*list(stored["prioritized"].rows)[:2], bad_id])
    with unchanged(client, stored, "prioritized"):
        error = raised(lambda: client.update_priorities("prioritized", ids, torch.ones(3)))
    assert_error(error, errors.InvalidIdsError, *fragments)


@pytest.mark.parametrize("value", [math.nan, -0.5, math.inf], ids=["nan", "negative", "inf"])
def test_bad_priority_in_an_update_applies_nothing(client, stored, value) -> None:
    ids = torch.tensor(list(stored["prioritized"].rows)[:3])
    priorities = torch.tensor([100.0, value, 50.0], dtype=torch.float64)
    with unchanged(client, stored, "prioritized"):
        error = raised(lambda: client.update_priorities("prioritized", ids, priorities))
    assert_error(error, errors.InvalidPriorityError, "finite and >= 0", "index 1")


def test_update_priorities_on_a_uniform_table_raises_no_priorities(client, stored) -> None:
    ids = torch.tensor(list(stored["uniform"].rows)[:2])
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: client.update_priorities("uniform", ids, torch.ones(2)))
    assert_error(error, errors.NoPrioritiesError, "'uniform'", "no priorities")


# ------------------------------------------------------------------------ sample

SAMPLE_WAYS: dict[str, Callable[[ReplayClient, str, int], Any]] = {
    "unary": lambda c, table, n: c.sample(table, n),
    "stream": first_batch,
}


@pytest.mark.parametrize("way", list(SAMPLE_WAYS))
@pytest.mark.parametrize("batch_size", [0, -1, -(2**40)],
                         ids=["zero", "minus-one", "very-negative"])
def test_non_positive_batch_size_raises_invalid_argument_naming_it(
    client, stored, way, batch_size
) -> None:
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: SAMPLE_WAYS[way](client, "uniform", batch_size))
    assert_error(error, errors.InvalidArgumentError, "batch_size", f"got {batch_size}")


def test_huge_batch_size_in_a_stream_raises_invalid_argument(client, stored) -> None:
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: first_batch(client, "uniform", 2**40))
    assert_error(error, errors.InvalidArgumentError, "batch_size", str(2**40))


def test_huge_batch_size_on_a_table_without_schema_raises_invalid_argument(
    client, stored
) -> None:
    with unchanged(client, stored, "empty"):
        error = raised(lambda: client.sample("empty", 2**40))
    assert_error(error, errors.InvalidArgumentError, "batch_size", str(2**40))


def test_huge_batch_size_in_a_unary_sample_raises_invalid_argument(client, stored) -> None:
    with unchanged(client, stored, "uniform"):
        error = raised(lambda: client.sample("uniform", 2**40))
    assert_error(error, errors.InvalidArgumentError, "batch_size", str(2**40))


@pytest.mark.parametrize("way", list(SAMPLE_WAYS))
def test_sample_from_an_empty_table_raises_empty_table_error(client, stored, way) -> None:
    with unchanged(client, stored, "empty"):
        error = raised(lambda: SAMPLE_WAYS[way](client, "empty", 4))
    assert_error(error, errors.EmptyTableError, "'empty'", "empty")


@pytest.mark.parametrize("table", SHORT_SLICE_TABLES)
def test_slice_sample_with_only_short_episodes_raises_empty_table_error(
    client, stored, table
) -> None:
    with unchanged(client, stored, table):
        error = raised(lambda: client.sample(table, 4))
    assert_error(error, errors.EmptyTableError, f"'{table}'", f"{SLICE_LEN} consecutive steps")


def test_a_sample_over_the_message_limit_arrives_whole_in_chunks(client, stored) -> None:
    batch = client.sample("big", BIG_BATCH)  # the unary Sample is refused, SampleChunks serves
    assert batch.ids.shape == (BIG_BATCH,)
    rows_by_id = stored["big"].rows
    for i, row_id in enumerate(batch.ids.tolist()):
        assert torch.equal(batch.data["pixels"][i], rows_by_id[row_id]["pixels"])


def test_stream_of_a_batch_over_the_message_limit_delivers_it_whole(client, stored) -> None:
    batch = first_batch(client, "big", BIG_BATCH)
    assert batch.ids.shape == (BIG_BATCH,)
    rows_by_id = stored["big"].rows
    for i, row_id in enumerate(batch.ids.tolist()):
        assert torch.equal(batch.data["pixels"][i], rows_by_id[row_id]["pixels"])


# ------------------------------------------------------------ valid samples


@pytest.mark.parametrize("table", ROW_TABLES + SLICE_TABLES)
def test_sample_returns_the_stored_rows(client, stored, table) -> None:
    assert_rows_are_stored(client, table, stored[table])


@pytest.mark.parametrize("table", SLICE_TABLES)
def test_slice_sample_has_slice_shaped_ids_and_data(client, stored, table) -> None:
    batch = client.sample(table, 8)
    assert batch.ids.shape == (8, SLICE_LEN)
    assert batch.data["obs"].shape == (8, SLICE_LEN, 3)
    assert (batch.ids[:, 1:] - batch.ids[:, :-1] == 1).all()


# --------------------------------------------------------- client-side errors


def test_complex_dtype_raises_invalid_argument_before_sending(offline_client) -> None:
    data = {"obs": torch.zeros(2, 3, dtype=torch.complex64)}
    error = raised(lambda: offline_client.insert("uniform", data))
    assert_error(error, errors.InvalidArgumentError, "'obs'", "complex64")


def test_a_key_that_is_leaf_and_parent_raises_invalid_argument_before_sending(
    offline_client,
) -> None:
    error = raised(lambda: offline_client.insert(
        "uniform", {"obs": torch.zeros(2), "obs.x": torch.zeros(2)}))
    assert_error(error, errors.InvalidArgumentError, "'obs'", "'obs.x'")


def test_data_that_is_not_a_mapping_raises_invalid_argument_before_sending(
    offline_client,
) -> None:
    error = raised(lambda: offline_client.insert("uniform", [torch.zeros(2)]))
    assert_error(error, errors.InvalidArgumentError, "mapping", "list")


def test_column_that_is_not_an_array_raises_invalid_argument_before_sending(
    offline_client,
) -> None:
    error = raised(lambda: offline_client.insert("uniform", {"obs": object()}))
    assert_error(error, errors.InvalidArgumentError, "'obs'")


# ----------------------------------------------------------- good inserts


def test_tensordict_insert_round_trips(client) -> None:
    data = TensorDict({"obs": torch.arange(12.0).reshape(4, 3), "action": torch.arange(4)},
                      batch_size=[4])
    ids = client.insert("scratch_tensordict", data)
    batch = client.sample("scratch_tensordict", 16)
    for i, row_id in enumerate(batch.ids.tolist()):
        k = ids.tolist().index(row_id)
        assert torch.equal(batch.data["obs"][i], data["obs"][k])
        assert batch.data["action"][i] == data["action"][k]


@pytest.mark.parametrize("kind", ["dict", "tensordict"])
def test_nested_insert_round_trips_its_structure(client, kind) -> None:
    nested = {"obs": {"pixels": torch.arange(8, dtype=torch.uint8).reshape(2, 2, 2),
                      "state": torch.ones(2, 3)},
              "action": torch.arange(2)}
    data = TensorDict(nested, batch_size=[2]) if kind == "tensordict" else nested
    client.insert("scratch_nested", data)
    batch = client.sample("scratch_nested", 4)
    assert batch.data["obs"]["pixels"].shape == (4, 2, 2)
    assert batch.data["obs"]["state"].shape == (4, 3)


def test_numpy_insert_round_trips(client) -> None:
    data = {"obs": np.arange(12, dtype=np.float32).reshape(4, 3),
            "flag": np.array([True, False, True, False])}
    ids = client.insert("scratch_numpy", data)
    assert ids.dtype == torch.int64 and ids.shape == (4,)
    batch = client.sample("scratch_numpy", 16)
    assert batch.data["obs"].dtype == torch.float32 and batch.data["flag"].dtype == torch.bool
    for i, row_id in enumerate(batch.ids.tolist()):
        k = ids.tolist().index(row_id)
        assert np.array_equal(batch.data["obs"][i].numpy(), data["obs"][k])
        assert bool(batch.data["flag"][i]) == data["flag"][k]


def test_checkpoint_without_a_checkpoint_dir_raises_no_checkpoint_dir_error(client) -> None:
    with pytest.raises(errors.NoCheckpointDirError, match="set server.checkpoint_dir"):
        client.checkpoint()


def test_server_logged_no_internal_error(served: ServerProcess, stored) -> None:
    log = served.log()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]

