"""Every bad input a table refuses: the exact typed error, a message naming what was
wrong, and a table left exactly as it was (size, counters, stored rows, sampler
state, random generator), so it still samples the very same batches.

Plus the positive input-handling cases that sit right beside the refusals.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from replay_proto.keys import flatten
from replay_server import errors
from replay_server.engine.config import SamplerKind, TableConfig
from replay_server.errors import (
    ConfigError,
    EmptyTableError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidIdsError,
    InvalidPriorityError,
    NoPrioritiesError,
    ReplayServerError,
    SchemaMismatchError,
    UnknownTableError,
)
from replay_server.engine.schema import FieldSpec
from replay_server.engine.table import MAX_BATCH_SIZE, STATE_VERSION, Table, TableCounters

KINDS = tuple(k.value for k in SamplerKind if not k.traits.consumes)  # the registry's
PRIORITIZED = tuple(k for k in KINDS if SamplerKind(k).is_prioritized)
UNPRIORITIZED = tuple(k for k in KINDS if not SamplerKind(k).is_prioritized)
SLICED = tuple(k for k in KINDS if SamplerKind(k).traits.slices)
CAPACITY = 8
SLICE_LEN = 3
STORED = 5  # rows in a filled table
PRIORITIES = [1.0, 2.0, 3.0, 4.0, 5.0]


# --------------------------------------------------------------------- helpers


def make_config(kind: str, **overrides: Any) -> TableConfig:
    fields: dict[str, Any] = {"name": kind, "capacity": CAPACITY, "sampler": kind, "seed": 7}
    if SamplerKind(kind).traits.slices:
        fields["slice_len"] = SLICE_LEN
    fields.update(overrides)
    return TableConfig(**fields)


def rows(kind: str, n: int, first: int = 0) -> dict[str, torch.Tensor]:
    """``n`` valid rows for a table of ``kind``, with values distinct per row.

    Slice kinds get one open episode (id 0), so ``n >= SLICE_LEN`` rows can be sampled.
    """
    values = torch.arange(first, first + n, dtype=torch.int64)
    data = {
        "obs": values.to(torch.float32).unsqueeze(1) * 10 + torch.arange(3, dtype=torch.float32),
        "action": values.clone(),
    }
    if SamplerKind(kind).traits.slices:
        data["episode"] = torch.zeros(n, dtype=torch.int64)
        data["done"] = torch.zeros(n, dtype=torch.bool)
    return data


def filled_table(kind: str, **overrides: Any) -> Table:
    """A seeded table of ``kind`` holding ``STORED`` known rows."""
    table = Table(make_config(kind, **overrides))
    priorities = PRIORITIES if SamplerKind(kind).is_prioritized else None
    table.insert(rows(kind, STORED), priorities=priorities)
    return table


@dataclass(frozen=True)
class Snapshot:
    size: int
    counters: TableCounters
    schema: dict[str, str] | None
    state: dict[str, Any]


def snapshot(table: Table) -> Snapshot:
    info = table.info()
    return Snapshot(info.size, info.counters, info.schema, table.state_dict())


def assert_same_state(got: Any, want: Any, path: str = "state") -> None:
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), path
        assert list(got) == list(want), path
        for key in want:
            assert_same_state(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got, want), path
    else:
        assert got == want, path


def draw(table: Table) -> Any:
    """A batch of 6, or the error's type when nothing can be sampled (now)."""
    try:
        return table.sample(6)
    except (EmptyTableError, errors.RateLimitedError) as exc:
        return type(exc)


def assert_same_draw(got: Any, want: Any) -> None:
    if isinstance(want, type):
        assert got is want
        return
    assert not isinstance(got, type)
    assert torch.equal(got.ids, want.ids)
    assert torch.equal(got.probabilities, want.probabilities)
    assert torch.equal(got.weights, want.weights)
    want_data, got_data = flatten(want.data), flatten(got.data)
    assert list(got_data) == list(want_data)
    for key in want_data:
        assert torch.equal(got_data[key], want_data[key]), key


def assert_unchanged(table: Table, before: Snapshot) -> None:
    """``table`` is exactly as ``before``, and samples what a copy of ``before`` samples."""
    info = table.info()
    assert info.size == before.size
    assert info.counters == before.counters
    assert info.schema == before.schema
    assert_same_state(table.state_dict(), before.state)
    twin = Table(table.config)
    twin.load_state_dict(before.state)
    assert_same_draw(draw(table), draw(twin))


def raises_exactly(error: type[Exception], match: str) -> Any:
    """Like pytest.raises, but the exception's class must be ``error`` itself."""

    class _Exact:
        def __enter__(self) -> Any:
            self._ctx = pytest.raises(error, match=match)
            self._info = self._ctx.__enter__()
            return self._info

        def __exit__(self, *exc: Any) -> bool:
            handled = bool(self._ctx.__exit__(*exc))
            if handled:  # otherwise a foreign exception propagates as is
                got = self._info.type
                assert got is error, f"raised {got.__name__}, want {error.__name__}"
            return handled

    return _Exact()


# ---------------------------------------------------------------- error classes


@pytest.mark.parametrize(
    "error, parent",
    [
        (SchemaMismatchError, InvalidArgumentError),
        (InvalidPriorityError, InvalidArgumentError),
        (InvalidIdsError, InvalidArgumentError),
        (ConfigError, InvalidArgumentError),
        (EmptyTableError, FailedPreconditionError),
        (NoPrioritiesError, FailedPreconditionError),
        (InvalidArgumentError, ReplayServerError),
        (FailedPreconditionError, ReplayServerError),
        (UnknownTableError, ReplayServerError),
    ],
    ids=lambda cls: cls.__name__,
)
def test_error_class_has_its_documented_parent(error: type, parent: type) -> None:
    assert issubclass(error, parent)


def test_every_error_class_is_a_replay_server_error() -> None:
    classes = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type)
        and issubclass(obj, Exception)
        and obj.__module__ == errors.__name__
    ]
    assert len(classes) >= 10  # the module's whole hierarchy was found
    assert all(issubclass(cls, ReplayServerError) for cls in classes)


@pytest.mark.parametrize(
    "error", [InvalidArgumentError, SchemaMismatchError, InvalidIdsError, UnknownTableError]
)
def test_invalid_input_errors_are_not_failed_preconditions(error: type) -> None:
    assert not issubclass(error, FailedPreconditionError)


@pytest.mark.parametrize(
    "error", [FailedPreconditionError, EmptyTableError, NoPrioritiesError, UnknownTableError]
)
def test_state_errors_are_not_invalid_arguments(error: type) -> None:
    assert not issubclass(error, InvalidArgumentError)


# --------------------------------------------------------------- insert: data


@dataclass(frozen=True)
class BadInsert:
    """One refused insert: ``make(kind)`` gives the ``insert`` kwargs."""

    id: str
    make: Callable[[str], dict[str, Any]]
    error: type[ReplayServerError]
    match: str
    kinds: tuple[str, ...] = KINDS


def _with(change: Callable[[dict[str, Any]], None]) -> Callable[[str], dict[str, Any]]:
    def make(kind: str) -> dict[str, Any]:
        data: dict[str, Any] = rows(kind, 3, first=100)
        change(data)
        priorities = [9.0, 9.0, 9.0] if SamplerKind(kind).is_prioritized else None
        return {"data": data, "priorities": priorities}

    return make


def _priorities(values: Any) -> Callable[[str], dict[str, Any]]:
    return lambda kind: {"data": rows(kind, 3, first=100), "priorities": values}


BAD_INSERTS = [
    BadInsert(
        "missing-key",
        _with(lambda d: d.pop("action")),
        SchemaMismatchError,
        r"table '\w+': insert does not match the schema: missing keys \['action'\]",
    ),
    BadInsert(
        "unexpected-key",
        _with(lambda d: d.update(extra=torch.zeros(3))),
        SchemaMismatchError,
        r"insert does not match the schema: unexpected keys \['extra'\]",
    ),
    BadInsert(
        "nested-instead-of-flat",
        _with(lambda d: d.update(action={"x": torch.zeros(3)})),
        SchemaMismatchError,
        r"missing keys \['action'\]; unexpected keys \['action\.x'\]",
    ),
    BadInsert(
        "wrong-dtype",
        _with(lambda d: d.update(obs=d["obs"].to(torch.float64))),
        SchemaMismatchError,
        r"key 'obs' expects dtype/shape float32\[3\] per row, got float64\[3\]",
    ),
    BadInsert(
        "wrong-int-dtype",
        _with(lambda d: d.update(action=d["action"].to(torch.int32))),
        SchemaMismatchError,
        r"key 'action' expects dtype/shape int64\[\] per row, got int32\[\]",
    ),
    BadInsert(
        "unsupported-dtype",
        _with(lambda d: d.update(obs=d["obs"].to(torch.complex64))),
        SchemaMismatchError,
        r"key 'obs' .*complex64",
    ),
    BadInsert(
        "wrong-row-shape",
        _with(lambda d: d.update(obs=torch.zeros(3, 4))),
        SchemaMismatchError,
        r"key 'obs' expects dtype/shape float32\[3\] per row, got float32\[4\]",
    ),
    BadInsert(
        "extra-row-dim",
        _with(lambda d: d.update(action=d["action"].unsqueeze(1))),
        SchemaMismatchError,
        r"key 'action' expects dtype/shape int64\[\] per row, got int64\[1\]",
    ),
    BadInsert(
        "different-leading-dims",
        _with(lambda d: d.update(action=torch.arange(4))),
        InvalidArgumentError,
        r"columns have different numbers of rows \(leading dims\): .*'obs': 3.*'action': 4",
    ),
    BadInsert(
        "scalar-column",
        _with(lambda d: d.update(action=torch.tensor(1))),
        InvalidArgumentError,
        r"key 'action' is a scalar; every column needs a leading dimension of rows",
    ),
    BadInsert(
        "python-scalar-value",
        _with(lambda d: d.update(action=7)),
        InvalidArgumentError,
        r"key 'action' is a scalar; every column needs a leading dimension of rows",
    ),
    BadInsert(
        "string-value",
        _with(lambda d: d.update(obs="pixels")),
        InvalidArgumentError,
        r"key 'obs' is not a tensor or array \(str\)",
    ),
    BadInsert(
        "object-value",
        _with(lambda d: d.update(obs=object())),
        InvalidArgumentError,
        r"key 'obs' is not a tensor or array \(object\)",
    ),
    BadInsert(
        "none-value",
        _with(lambda d: d.update(obs=None)),
        InvalidArgumentError,
        r"key 'obs' is not a tensor or array \(NoneType\)",
    ),
    BadInsert(
        "ragged-list-value",
        _with(lambda d: d.update(obs=[[1.0, 2.0], [3.0]])),
        InvalidArgumentError,
        r"key 'obs' is not a tensor or array \(list\)",
    ),
    BadInsert(
        "dotted-key",
        _with(lambda d: d.update({"obs.x": torch.zeros(3)})),
        InvalidArgumentError,
        r"key 'obs' is both a value and the parent of 'obs\.x'",
    ),
    BadInsert(
        "non-string-key",
        _with(lambda d: d.update({1: torch.zeros(3)})),
        InvalidArgumentError,
        r"keys must be strings, got 1 \(int\)",
    ),
    BadInsert(
        "empty-nested-mapping",
        _with(lambda d: d.update(obs={})),
        InvalidArgumentError,
        r"nested key 'obs' holds an empty mapping",
    ),
    BadInsert(
        "non-mapping",
        lambda kind: {"data": [rows(kind, 3)["obs"]]},
        InvalidArgumentError,
        r"table '\w+': expected a mapping of column name to tensor .*got list",
    ),
    BadInsert(
        "tensor-instead-of-mapping",
        lambda kind: {"data": torch.zeros(3, 3)},
        InvalidArgumentError,
        r"expected a mapping of column name to tensor .*got Tensor",
    ),
    BadInsert(
        "no-columns",
        lambda kind: {"data": {}},
        InvalidArgumentError,
        r"table '\w+': insert has no columns",
    ),
    BadInsert(
        "more-rows-than-capacity",
        lambda kind: {"data": rows(kind, CAPACITY + 1, first=100)},
        InvalidArgumentError,
        rf"an insert of {CAPACITY + 1} rows exceeds the table's capacity of {CAPACITY} rows",
        UNPRIORITIZED,
    ),
    BadInsert(
        "priorities-on-unprioritized-table",
        _priorities([1.0, 1.0, 1.0]),
        NoPrioritiesError,
        r"table '(uniform|slice)' uses sampler '(uniform|slice)', which has no priorities",
        UNPRIORITIZED,
    ),
    BadInsert(
        "priorities-too-few",
        _priorities([1.0, 1.0]),
        InvalidPriorityError,
        r"priorities must have shape \[3\] \(one per row\), got \[2\]",
        PRIORITIZED,
    ),
    BadInsert(
        "priorities-2d",
        _priorities([[1.0], [1.0], [1.0]]),
        InvalidPriorityError,
        r"priorities must have shape \[3\] \(one per row\), got \[3, 1\]",
        PRIORITIZED,
    ),
    BadInsert(
        "priorities-scalar",
        _priorities(1.0),
        InvalidPriorityError,
        r"priorities must have shape \[3\] \(one per row\), got \[\]",
        PRIORITIZED,
    ),
    BadInsert(
        "priority-negative",
        _priorities([1.0, -1.0, 1.0]),
        InvalidPriorityError,
        r"priorities must be finite and >= 0; 1 are not \(first at index 1: -1\.0\)",
        PRIORITIZED,
    ),
    BadInsert(
        "priority-nan",
        _priorities([1.0, 1.0, float("nan")]),
        InvalidPriorityError,
        r"priorities must be finite and >= 0; 1 are not \(first at index 2: nan\)",
        PRIORITIZED,
    ),
    BadInsert(
        "priority-inf",
        _priorities([float("inf"), 1.0, float("-inf")]),
        InvalidPriorityError,
        r"priorities must be finite and >= 0; 2 are not \(first at index 0: inf\)",
        PRIORITIZED,
    ),
    BadInsert(
        "priority-bool",
        _priorities(torch.ones(3, dtype=torch.bool)),
        InvalidPriorityError,
        r"priorities must be real numbers, got dtype torch\.bool",
        PRIORITIZED,
    ),
    BadInsert(
        "priority-bool-numpy",
        _priorities(np.array([True, False, True])),
        InvalidPriorityError,
        r"priorities must be real numbers, got dtype torch\.bool",
        PRIORITIZED,
    ),
]

_BAD_INSERT_PARAMS = [
    pytest.param(kind, case, id=f"{case.id}-{kind}") for case in BAD_INSERTS for kind in case.kinds
]


@pytest.mark.parametrize("kind, case", _BAD_INSERT_PARAMS)
def test_bad_insert_raises_typed_error_naming_the_problem(kind: str, case: BadInsert) -> None:
    table = filled_table(kind)
    with raises_exactly(case.error, case.match):
        table.insert(**case.make(kind))


@pytest.mark.parametrize("kind, case", _BAD_INSERT_PARAMS)
def test_bad_insert_leaves_table_unchanged(kind: str, case: BadInsert) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    with pytest.raises(ReplayServerError):
        table.insert(**case.make(kind))
    assert_unchanged(table, before)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_insert_message_names_the_table(kind: str) -> None:
    data = rows(kind, 3)
    data["obs"] = data["obs"].to(torch.float64)
    with pytest.raises(SchemaMismatchError, match=rf"^table '{kind}': "):
        filled_table(kind).insert(data)


@pytest.mark.parametrize("kind", PRIORITIZED)
def test_more_rows_than_capacity_with_priorities_raises_invalid_argument(kind: str) -> None:
    table = filled_table(kind)
    with raises_exactly(InvalidArgumentError, r"exceeds the table's capacity of 8 rows"):
        table.insert(rows(kind, CAPACITY + 1), priorities=[1.0] * (CAPACITY + 1))


# ------------------------------------------------- insert: a table's first insert


@dataclass(frozen=True)
class BadFirstInsert:
    id: str
    change: Callable[[dict[str, Any]], None]
    error: type[ReplayServerError]
    match: str
    kinds: tuple[str, ...] = KINDS


BAD_FIRST_INSERTS = [
    BadFirstInsert(
        "no-episode-key",
        lambda d: d.pop("episode"),
        SchemaMismatchError,
        r"sampler '\w+' needs key 'episode' holding one integer episode id per row "
        r"\(e\.g\. int64\[\]\), got no such key",
        SLICED,
    ),
    BadFirstInsert(
        "float-episode-key",
        lambda d: d.update(episode=torch.zeros(3, dtype=torch.float32)),
        SchemaMismatchError,
        r"needs key 'episode' holding one integer episode id per row .*got float32\[\]",
        SLICED,
    ),
    BadFirstInsert(
        "bool-episode-key",
        lambda d: d.update(episode=torch.zeros(3, dtype=torch.bool)),
        SchemaMismatchError,
        r"needs key 'episode' .*got bool\[\]",
        SLICED,
    ),
    BadFirstInsert(
        "episode-key-not-one-per-row",
        lambda d: d.update(episode=torch.zeros(3, 2, dtype=torch.int64)),
        SchemaMismatchError,
        r"needs key 'episode' .*got int64\[2\]",
        SLICED,
    ),
    BadFirstInsert(
        "int-done-key",
        lambda d: d.update(done=torch.zeros(3, dtype=torch.int64)),
        SchemaMismatchError,
        r"key 'done' marks episode ends and must hold one bool per row \(bool\[\], or bool\[1\] as TorchRL's flags\), got int64\[\]",
        SLICED,
    ),
    BadFirstInsert(
        "float-truncated-key",
        lambda d: d.update(truncated=torch.zeros(3, dtype=torch.float32)),
        SchemaMismatchError,
        r"key 'truncated' marks episode ends .*got float32\[\]",
        SLICED,
    ),
    BadFirstInsert(
        "done-key-not-one-per-row",
        lambda d: d.update(done=torch.zeros(3, 2, dtype=torch.bool)),  # [1] is TorchRL's: fine
        SchemaMismatchError,
        r"key 'done' marks episode ends .*got bool\[2\]",
        SLICED,
    ),
    BadFirstInsert(
        "more-rows-than-capacity",
        lambda d: d.update({k: torch.cat([v] * 3) for k, v in d.items()}),
        InvalidArgumentError,
        r"an insert of 9 rows exceeds the table's capacity of 8 rows",
        UNPRIORITIZED,
    ),
]

_BAD_FIRST_PARAMS = [
    pytest.param(kind, case, id=f"{case.id}-{kind}")
    for case in BAD_FIRST_INSERTS
    for kind in case.kinds
]


@pytest.mark.parametrize("kind, case", _BAD_FIRST_PARAMS)
def test_bad_first_insert_raises_typed_error_naming_the_problem(
    kind: str, case: BadFirstInsert
) -> None:
    data: dict[str, Any] = rows(kind, 3)
    case.change(data)
    with raises_exactly(case.error, case.match):
        Table(make_config(kind)).insert(data)


@pytest.mark.parametrize("kind, case", _BAD_FIRST_PARAMS)
def test_bad_first_insert_leaves_table_unchanged(kind: str, case: BadFirstInsert) -> None:
    table = Table(make_config(kind))
    before = snapshot(table)
    data: dict[str, Any] = rows(kind, 3)
    case.change(data)
    with pytest.raises(ReplayServerError):
        table.insert(data)
    assert_unchanged(table, before)


@pytest.mark.parametrize("kind, case", _BAD_FIRST_PARAMS)
def test_bad_first_insert_does_not_fix_the_schema(kind: str, case: BadFirstInsert) -> None:
    table = Table(make_config(kind))
    data: dict[str, Any] = rows(kind, 3)
    case.change(data)
    with pytest.raises(ReplayServerError):
        table.insert(data)
    assert table.schema is None


@pytest.mark.parametrize("kind", SLICED)
def test_valid_insert_after_a_refused_first_insert_fixes_its_own_schema(kind: str) -> None:
    table = Table(make_config(kind))
    bad = rows(kind, 3)
    bad["episode"] = bad["episode"].float()
    with pytest.raises(SchemaMismatchError):
        table.insert(bad)
    good = {"episode": torch.zeros(3, dtype=torch.int64), "x": torch.ones(3, 2)}
    table.insert(good)
    assert table.schema is not None
    assert table.schema.describe() == {"episode": "int64[]", "x": "float32[2]"}


@pytest.mark.parametrize("kind", SLICED)
def test_declared_schema_without_episode_column_raises_config_error(kind: str) -> None:
    schema = {"obs": FieldSpec(torch.float32, (3,)), "done": FieldSpec(torch.bool)}
    with raises_exactly(ConfigError, rf"table '{kind}': .*needs key 'episode' .*got no such key"):
        Table(make_config(kind, schema=schema))


@pytest.mark.parametrize("kind", SLICED)
def test_declared_schema_with_float_episode_column_raises_config_error(kind: str) -> None:
    schema = {"obs": FieldSpec(torch.float32, (3,)), "episode": FieldSpec(torch.float64)}
    with raises_exactly(ConfigError, r"needs key 'episode' .*got float64\[\]"):
        Table(make_config(kind, schema=schema))


@pytest.mark.parametrize("kind", SLICED)
def test_declared_schema_with_non_bool_done_column_raises_config_error(kind: str) -> None:
    schema = {"episode": FieldSpec(torch.int64), "done": FieldSpec(torch.uint8)}
    with raises_exactly(ConfigError, r"key 'done' marks episode ends .*got uint8\[\]"):
        Table(make_config(kind, schema=schema))


UNSUPPORTED_COLUMNS = [
    pytest.param(torch.zeros(3, dtype=torch.complex64), id="complex64"),
    pytest.param(np.zeros(3, dtype=np.uint32), id="numpy-uint32"),
]


@pytest.mark.parametrize("column", UNSUPPORTED_COLUMNS)
def test_first_insert_with_unsupported_dtype_raises_schema_mismatch(column: Any) -> None:
    table = Table(make_config("uniform"))
    with raises_exactly(SchemaMismatchError, r"^table 'uniform': key 'x' .*(complex64|uint32)"):
        table.insert({"x": column, "action": torch.arange(3)})


@pytest.mark.parametrize("column", UNSUPPORTED_COLUMNS)
def test_first_insert_with_unsupported_dtype_leaves_table_unchanged(column: Any) -> None:
    table = Table(make_config("uniform"))
    before = snapshot(table)
    with pytest.raises(ReplayServerError):
        table.insert({"x": column, "action": torch.arange(3)})
    assert_unchanged(table, before)


def test_python_scalar_first_insert_is_refused_as_scalar() -> None:
    with raises_exactly(InvalidArgumentError, r"key 'x' is a scalar"):
        Table(make_config("uniform")).insert({"x": 1.0})


# ---------------------------------------------------------------------- sample


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "batch_size",
    [0, -1, 2.0, True, MAX_BATCH_SIZE + 1, "4", None, np.int64(0)],
    ids=["zero", "negative", "float", "bool", "huge", "str", "none", "numpy-int-zero"],
)
def test_bad_batch_size_raises_invalid_argument_naming_it(kind: str, batch_size: Any) -> None:
    pattern = (
        rf"table '{kind}': batch_size must be an integer in \[1, {MAX_BATCH_SIZE}\], "
        rf"got {re.escape(repr(batch_size))}"
    )
    with raises_exactly(InvalidArgumentError, pattern):
        filled_table(kind).sample(batch_size)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_size", [0, -1, 2.0, True, MAX_BATCH_SIZE + 1])
def test_bad_batch_size_leaves_table_unchanged(kind: str, batch_size: Any) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    with pytest.raises(InvalidArgumentError):
        table.sample(batch_size)
    assert_unchanged(table, before)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_from_new_table_raises_empty_table_naming_it(kind: str) -> None:
    with raises_exactly(EmptyTableError, rf"^table '{kind}': the table is empty"):
        Table(make_config(kind)).sample(4)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_from_reset_table_raises_empty_table_naming_it(kind: str) -> None:
    table = filled_table(kind)
    table.reset()
    with raises_exactly(EmptyTableError, rf"^table '{kind}': the table is empty"):
        table.sample(4)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_from_empty_table_leaves_it_unchanged(kind: str) -> None:
    table = filled_table(kind)
    table.reset()
    before = snapshot(table)
    with pytest.raises(EmptyTableError):
        table.sample(4)
    assert_unchanged(table, before)


@pytest.mark.parametrize(
    "kind, what", [("prioritized", "row"), ("prioritized_slice", "slice start")]
)
def test_sample_when_every_priority_is_zero_raises_empty_table(kind: str, what: str) -> None:
    table = Table(make_config(kind))
    table.insert(rows(kind, STORED), priorities=[0.0] * STORED)
    with raises_exactly(EmptyTableError, rf"^table '{kind}': every {what} has priority 0"):
        table.sample(4)


@pytest.mark.parametrize("kind", PRIORITIZED)
def test_sample_when_every_priority_is_updated_to_zero_raises_empty_table(kind: str) -> None:
    table = filled_table(kind)
    table.update_priorities(torch.arange(STORED), torch.zeros(STORED))
    with raises_exactly(EmptyTableError, r"has priority 0"):
        table.sample(4)


@pytest.mark.parametrize("kind", PRIORITIZED)
def test_sample_when_every_priority_is_zero_leaves_table_unchanged(kind: str) -> None:
    table = Table(make_config(kind))
    table.insert(rows(kind, STORED), priorities=[0.0] * STORED)
    before = snapshot(table)
    with pytest.raises(EmptyTableError):
        table.sample(4)
    assert_unchanged(table, before)


def short_episodes(kind: str) -> dict[str, torch.Tensor]:
    """Two finished episodes and one open one, each shorter than SLICE_LEN."""
    data = rows(kind, 6)
    data["episode"] = torch.tensor([0, 0, 1, 1, 2, 2])
    data["done"] = torch.tensor([False, True, False, True, False, False])
    return data


@pytest.mark.parametrize("kind", SLICED)
def test_sample_when_every_episode_is_shorter_than_slice_len_raises_empty_table(kind: str) -> None:
    table = Table(make_config(kind))
    table.insert(short_episodes(kind))
    pattern = rf"^table '{kind}': no episode has {SLICE_LEN} consecutive steps .*slice_len"
    with raises_exactly(EmptyTableError, pattern):
        table.sample(4)


@pytest.mark.parametrize("kind", SLICED)
def test_sample_when_every_episode_is_short_leaves_table_unchanged(kind: str) -> None:
    table = Table(make_config(kind))
    table.insert(short_episodes(kind))
    before = snapshot(table)
    with pytest.raises(EmptyTableError):
        table.sample(4)
    assert_unchanged(table, before)


# ----------------------------------------------------------- update_priorities


@pytest.mark.parametrize("kind", UNPRIORITIZED)
def test_update_priorities_on_unprioritized_table_raises_no_priorities(kind: str) -> None:
    pattern = rf"table '{kind}' uses sampler '{kind}', which has no priorities to update"
    with raises_exactly(NoPrioritiesError, pattern):
        filled_table(kind).update_priorities(torch.arange(2), torch.ones(2))


@pytest.mark.parametrize("kind", UNPRIORITIZED)
def test_update_priorities_on_unprioritized_table_leaves_it_unchanged(kind: str) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    with pytest.raises(NoPrioritiesError):
        table.update_priorities(torch.arange(2), torch.ones(2))
    assert_unchanged(table, before)


@dataclass(frozen=True)
class BadUpdate:
    id: str
    ids: Any
    priorities: Any
    error: type[ReplayServerError]
    match: str


BAD_UPDATES = [
    BadUpdate(
        "float32-ids",
        torch.tensor([0.0, 1.0]),
        [1.0, 1.0],
        InvalidIdsError,
        r"ids must be int64 \(as returned by insert and sample\), got dtype torch\.float32",
    ),
    BadUpdate(
        "int32-ids",
        torch.tensor([0, 1], dtype=torch.int32),
        [1.0, 1.0],
        InvalidIdsError,
        r"ids must be int64 .*got dtype torch\.int32",
    ),
    BadUpdate(
        "bool-ids",
        torch.tensor([True, False]),
        [1.0, 1.0],
        InvalidIdsError,
        r"ids must be int64 .*got dtype torch\.bool",
    ),
    BadUpdate(
        "never-issued-id",
        torch.tensor([0, STORED]),
        [7.0, 7.0],
        InvalidIdsError,
        rf"id {STORED} was never issued by this table \(incarnation 0 has issued sequences "
        rf"0\.\.{STORED - 1} so far",
    ),
    BadUpdate(
        "far-future-id",
        torch.tensor([10**12]),
        [7.0],
        InvalidIdsError,
        r"id 1000000000000 was never issued",
    ),
    BadUpdate(
        "negative-id",
        torch.tensor([1, -1]),
        [7.0, 7.0],
        InvalidIdsError,
        r"-1 is not an id \(ids are non-negative int64",
    ),
    BadUpdate(
        "other-shard-id",
        torch.tensor([1, (3 << 56) | 1]),
        [7.0, 7.0],
        InvalidIdsError,
        r"id 216172782113783809 belongs to shard 3, and this server is shard 0",
    ),
    BadUpdate(
        "priorities-longer-than-ids",
        torch.tensor([0, 1]),
        [1.0, 1.0, 1.0],
        InvalidPriorityError,
        r"priorities must have the same shape as ids \[2\], got \[3\]",
    ),
    BadUpdate(
        "priorities-other-shape",
        torch.tensor([[0, 1]]),
        [1.0, 1.0],
        InvalidPriorityError,
        r"priorities must have the same shape as ids \[1, 2\], got \[2\]",
    ),
    BadUpdate(
        "one-nan-priority",
        torch.tensor([0, 1, 2]),
        [9.0, float("nan"), 9.0],
        InvalidPriorityError,
        r"priorities must be finite and >= 0; 1 are not \(first at index 1: nan\)",
    ),
    BadUpdate(
        "one-negative-priority",
        torch.tensor([0, 1, 2]),
        [9.0, 9.0, -2.0],
        InvalidPriorityError,
        r"priorities must be finite and >= 0; 1 are not \(first at index 2: -2\.0\)",
    ),
    BadUpdate(
        "one-inf-priority",
        torch.tensor([0, 1, 2]),
        [float("inf"), 9.0, 9.0],
        InvalidPriorityError,
        r"first at index 0: inf",
    ),
    BadUpdate(
        "bool-priorities",
        torch.tensor([0, 1]),
        torch.tensor([True, True]),
        InvalidPriorityError,
        r"priorities must be real numbers, got dtype torch\.bool",
    ),
]

_BAD_UPDATE_PARAMS = [
    pytest.param(kind, case, id=f"{case.id}-{kind}") for case in BAD_UPDATES for kind in PRIORITIZED
]


@pytest.mark.parametrize("kind, case", _BAD_UPDATE_PARAMS)
def test_bad_update_raises_typed_error_naming_the_problem(kind: str, case: BadUpdate) -> None:
    table = filled_table(kind)
    with raises_exactly(case.error, rf"^table '{kind}': .*{case.match}"):
        table.update_priorities(case.ids, case.priorities)


@pytest.mark.parametrize("kind, case", _BAD_UPDATE_PARAMS)
def test_bad_update_leaves_table_unchanged(kind: str, case: BadUpdate) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    with pytest.raises(ReplayServerError):
        table.update_priorities(case.ids, case.priorities)
    assert_unchanged(table, before)


def test_update_with_one_bad_priority_applies_none_of_the_batch() -> None:
    table = filled_table("prioritized")
    leaves = table.state_dict()["sampler"]["tree"]["leaves"].clone()
    with pytest.raises(InvalidPriorityError):
        table.update_priorities(torch.arange(STORED), [100.0, 100.0, -1.0, 100.0, 100.0])
    assert torch.equal(table.state_dict()["sampler"]["tree"]["leaves"], leaves)


def test_update_with_one_bad_priority_keeps_sampling_probabilities() -> None:
    table = filled_table("prioritized")
    twin = filled_table("prioritized")
    with pytest.raises(InvalidPriorityError):
        table.update_priorities(torch.arange(STORED), [100.0, float("nan"), 100.0, 100.0, 100.0])
    assert torch.equal(table.sample(64).probabilities, twin.sample(64).probabilities)


def test_update_with_one_bad_priority_keeps_max_priority_for_new_rows() -> None:
    table = filled_table("prioritized")
    with pytest.raises(InvalidPriorityError):
        table.update_priorities(torch.arange(2), [1000.0, -1.0])
    assert table.info().sampler_stats["max_priority"] == max(PRIORITIES)



# A finite priority whose sampling mass p**alpha does not fit the float32 sum tree would
# poison it (inf total: wrong rows drawn with probability 0 and NaN weights), so it is refused.
HUGE_PRIORITIES = [
    pytest.param(1.0, 1e39, id="alpha1-over-float32"),
    pytest.param(0.5, 1e78, id="alpha0.5-over-float32"),
    pytest.param(2.0, 1e200, id="alpha2-over-float64"),
]


@pytest.mark.parametrize("kind", PRIORITIZED)
@pytest.mark.parametrize("alpha, priority", HUGE_PRIORITIES)
def test_update_with_priority_mass_beyond_float32_raises_invalid_priority(
    kind: str, alpha: float, priority: float
) -> None:
    table = filled_table(kind, alpha=alpha)
    with raises_exactly(InvalidPriorityError, r"^table '\w+': priority .*too large"):
        table.update_priorities(torch.tensor([0]), torch.tensor([priority], dtype=torch.float64))


@pytest.mark.parametrize("kind", PRIORITIZED)
@pytest.mark.parametrize("alpha, priority", HUGE_PRIORITIES)
def test_insert_with_priority_mass_beyond_float32_raises_invalid_priority(
    kind: str, alpha: float, priority: float
) -> None:
    table = filled_table(kind, alpha=alpha)
    with raises_exactly(InvalidPriorityError, r"^table '\w+': priority .*too large"):
        table.insert(rows(kind, 1, first=50), priorities=[priority])


@pytest.mark.parametrize("kind", PRIORITIZED)
@pytest.mark.parametrize("alpha, priority", [(1.0, 1e39), (0.5, 1e78), (2.0, 1e200)])
def test_update_with_priority_mass_beyond_float32_leaves_table_unchanged(
    kind: str, alpha: float, priority: float
) -> None:
    table = filled_table(kind, alpha=alpha)
    before = snapshot(table)
    with pytest.raises(Exception):  # noqa: B017 - the class is the test above's concern
        table.update_priorities(torch.tensor([0]), torch.tensor([priority], dtype=torch.float64))
    assert_unchanged(table, before)


# ------------------------------------------------------------- load_state_dict


@dataclass(frozen=True)
class BadState:
    id: str
    make: Callable[[str], dict[str, Any]]
    match: str
    kinds: tuple[str, ...] = KINDS


def _other_kind(kind: str) -> str:
    return KINDS[(KINDS.index(kind) + 1) % len(KINDS)]


def _wrong_version(kind: str) -> dict[str, Any]:
    state = filled_table(kind).state_dict()
    state["version"] = STATE_VERSION + 98
    return state


def _other_schema(kind: str) -> dict[str, Any]:
    table = Table(make_config(kind))
    data = rows(kind, STORED)
    data["obs"] = data["obs"].to(torch.float64)
    table.insert(data, priorities=PRIORITIES if SamplerKind(kind).is_prioritized else None)
    return table.state_dict()


BAD_STATES = [
    BadState(
        "wrong-version",
        _wrong_version,
        rf"saved state has layout version {STATE_VERSION + 98}, this server reads version "
        rf"{STATE_VERSION}",
    ),
    BadState(
        "missing-version",
        lambda kind: {k: v for k, v in filled_table(kind).state_dict().items() if k != "version"},
        rf"saved state has layout version None, this server reads version {STATE_VERSION}",
    ),
    BadState(
        "capacity",
        lambda kind: filled_table(kind, capacity=16).state_dict(),
        rf"config says capacity={CAPACITY} but the saved state has capacity=16",
    ),
    BadState(
        "sampler",
        lambda kind: filled_table(_other_kind(kind), name=kind).state_dict(),
        r"config says sampler='(\w+)' but the saved state has sampler='(?!\1)\w+'",
    ),
    BadState(
        "slice-len",
        lambda kind: filled_table(kind, slice_len=SLICE_LEN + 1).state_dict(),
        rf"config says slice_len={SLICE_LEN} but the saved state has slice_len={SLICE_LEN + 1}",
        SLICED,
    ),
    BadState(
        "alpha",
        lambda kind: filled_table(kind, alpha=0.7).state_dict(),
        r"config says alpha=0\.6 but the saved state has alpha=0\.7",
        PRIORITIZED,
    ),
    BadState(
        "episode-key",
        lambda kind: Table(make_config(kind, episode_key="ep")).state_dict(),
        r"config says episode_key='episode' but the saved state has episode_key='ep'",
        SLICED,
    ),
    BadState(
        "schema",
        _other_schema,
        r".*schema is \{'obs': 'float32\[3\]'.* but the saved state has \{'obs': 'float64\[3\]'",
    ),
]

_BAD_STATE_PARAMS = [
    pytest.param(kind, case, id=f"{case.id}-{kind}") for case in BAD_STATES for kind in case.kinds
]


@pytest.mark.parametrize("kind, case", _BAD_STATE_PARAMS)
def test_bad_state_raises_config_error_naming_both_values(kind: str, case: BadState) -> None:
    table = filled_table(kind)
    state = case.make(kind)
    with raises_exactly(ConfigError, rf"^table '{kind}': {case.match}"):
        table.load_state_dict(state)


@pytest.mark.parametrize("kind, case", _BAD_STATE_PARAMS)
def test_bad_state_leaves_table_unchanged(kind: str, case: BadState) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    state = case.make(kind)
    with pytest.raises(ConfigError):
        table.load_state_dict(state)
    assert_unchanged(table, before)


def _inconsistent_ring(state: dict[str, Any]) -> None:
    state["ring"] = {"next_id": 3, "first_live": 5}


def _missing_column(state: dict[str, Any]) -> None:
    state["columns"] = {"obs": torch.zeros(STORED, 3)}


def _missing_sampler(state: dict[str, Any]) -> None:
    del state["sampler"]


# (corruption, load into a new table rather than a filled one)
CORRUPT_STATES = [
    pytest.param(_inconsistent_ring, True, id="inconsistent-ring-into-new-table"),
    pytest.param(_missing_column, False, id="missing-column-into-filled-table"),
    pytest.param(_missing_sampler, False, id="missing-sampler-into-filled-table"),
]



@pytest.mark.parametrize("corrupt, new_table", CORRUPT_STATES)
def test_corrupt_state_raises_config_error(
    corrupt: Callable[[dict[str, Any]], None], new_table: bool
) -> None:
    table = Table(make_config("uniform")) if new_table else filled_table("uniform")
    state = filled_table("uniform").state_dict()
    corrupt(state)
    with pytest.raises(ConfigError):
        table.load_state_dict(state)


@pytest.mark.parametrize("corrupt, new_table", CORRUPT_STATES[:2])
def test_corrupt_state_leaves_table_unchanged(
    corrupt: Callable[[dict[str, Any]], None], new_table: bool
) -> None:
    table = Table(make_config("uniform")) if new_table else filled_table("uniform")
    before = snapshot(table)
    state = filled_table("uniform").state_dict()
    corrupt(state)
    with pytest.raises(Exception):  # noqa: B017 - the class is the other test's concern
        table.load_state_dict(state)
    assert_unchanged(table, before)


@pytest.mark.parametrize("kind", KINDS)
def test_state_with_other_beta_is_accepted(kind: str) -> None:
    table = filled_table(kind)
    table.load_state_dict(filled_table(kind, beta=0.9).state_dict())
    assert table.size == STORED


# ------------------------------------------------------- accepted input forms


def test_numpy_arrays_are_accepted_as_columns() -> None:
    table = Table(make_config("uniform"))
    obs = np.arange(12, dtype=np.float32).reshape(4, 3)
    table.insert({"obs": obs, "action": np.arange(4, dtype=np.int64)})
    batch = table.sample(8)
    assert torch.equal(batch.data["obs"], torch.from_numpy(obs)[batch.ids])


def test_numpy_columns_fix_numpy_dtypes_in_the_schema() -> None:
    table = Table(make_config("uniform"))
    table.insert({"obs": np.zeros((4, 3), dtype=np.float32), "flag": np.zeros(4, dtype=bool)})
    assert table.schema is not None
    assert table.schema.describe() == {"obs": "float32[3]", "flag": "bool[]"}


def test_numpy_array_with_other_dtype_is_refused_like_a_tensor() -> None:
    table = filled_table("uniform")
    data: dict[str, Any] = rows("uniform", 2)
    data["obs"] = data["obs"].numpy().astype(np.float64)
    pattern = r"key 'obs' expects dtype/shape float32\[3\] per row, got float64\[3\]"
    with raises_exactly(SchemaMismatchError, pattern):
        table.insert(data)


def test_numpy_array_view_with_negative_strides_is_accepted() -> None:
    table = Table(make_config("uniform"))
    obs = np.arange(12, dtype=np.float32).reshape(4, 3)[::-1]
    ids = table.insert({"obs": obs, "action": np.arange(4)})
    assert ids.tolist() == [0, 1, 2, 3]


def test_python_lists_are_accepted_as_columns() -> None:
    table = Table(make_config("uniform"))
    table.insert({"obs": [[1.0, 2.0], [3.0, 4.0]], "action": [1, 2]})
    assert table.size == 2


def test_tensordict_insert_is_accepted() -> None:
    table = Table(make_config("uniform"))
    td = TensorDict(
        {"obs": {"pixels": torch.zeros(4, 2, 2, dtype=torch.uint8), "state": torch.ones(4, 3)},
         "action": torch.arange(4)},
        batch_size=[4],
    )
    assert table.insert(td).tolist() == [0, 1, 2, 3]


def test_tensordict_insert_fixes_flat_keys_in_the_schema() -> None:
    table = Table(make_config("uniform"))
    td = TensorDict({"obs": {"pixels": torch.zeros(4, 2, 2, dtype=torch.uint8)}}, batch_size=[4])
    table.insert(td)
    assert table.schema is not None and table.schema.describe() == {"obs.pixels": "uint8[2, 2]"}


def test_tensordict_insert_samples_back_nested() -> None:
    table = Table(make_config("uniform"))
    state = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    td = TensorDict({"obs": {"state": state}, "action": torch.arange(4)}, batch_size=[4])
    table.insert(td)
    batch = table.sample(5)
    assert torch.equal(batch.data["obs"]["state"], state[batch.ids])


def test_tensordict_and_dict_inserts_share_one_schema() -> None:
    table = Table(make_config("uniform"))
    table.insert({"obs": {"state": torch.zeros(2, 3)}})
    table.insert(TensorDict({"obs": {"state": torch.ones(2, 3)}}, batch_size=[2]))
    assert table.size == 4


@pytest.mark.parametrize("kind", SLICED)
def test_tensordict_insert_into_slice_table_samples_slices(kind: str) -> None:
    table = Table(make_config(kind))
    table.insert(TensorDict(rows(kind, STORED), batch_size=[STORED]))
    assert table.sample(2).to_tensordict().batch_size == torch.Size([2, SLICE_LEN])


@pytest.mark.parametrize("kind", KINDS)
def test_zero_row_insert_returns_empty_int64_ids(kind: str) -> None:
    ids = filled_table(kind).insert(rows(kind, 0))
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (0,)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_row_insert_leaves_table_unchanged(kind: str) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    table.insert(rows(kind, 0))
    assert_unchanged(table, before)


@pytest.mark.parametrize("kind", PRIORITIZED)
def test_zero_row_insert_with_empty_priorities_leaves_table_unchanged(kind: str) -> None:
    table = filled_table(kind)
    before = snapshot(table)
    table.insert(rows(kind, 0), priorities=[])
    assert_unchanged(table, before)


def test_zero_row_first_insert_does_not_fix_the_schema() -> None:
    table = Table(make_config("uniform"))
    table.insert(rows("uniform", 0))
    assert table.schema is None


def test_zero_row_insert_with_wrong_schema_is_still_refused() -> None:
    table = filled_table("uniform")
    data = rows("uniform", 0)
    data["obs"] = data["obs"].to(torch.float64)
    with raises_exactly(SchemaMismatchError, r"key 'obs' expects dtype/shape float32\[3\]"):
        table.insert(data)


def test_uniform_table_stores_episode_and_done_as_data() -> None:
    table = Table(make_config("uniform"))
    data = rows("slice", 4)  # has int64 episode and bool done
    data["done"] = torch.tensor([False, True, False, True])
    table.insert(data)
    assert table.schema is not None
    assert table.schema.describe() == {
        "obs": "float32[3]",
        "action": "int64[]",
        "episode": "int64[]",
        "done": "bool[]",
    }


def test_uniform_table_samples_episode_and_done_as_plain_rows() -> None:
    table = Table(make_config("uniform"))
    data = rows("slice", 4)
    data["done"] = torch.tensor([False, True, False, True])
    table.insert(data)
    batch = table.sample(6)
    assert tuple(batch.ids.shape) == (6,)
    assert torch.equal(batch.data["done"], data["done"][batch.ids])


def test_uniform_table_accepts_float_episode_and_int_done_as_data() -> None:
    table = Table(make_config("uniform"))
    table.insert({"episode": torch.zeros(3), "done": torch.zeros(3, dtype=torch.int64)})
    assert table.size == 3


@pytest.mark.parametrize("alpha, priority", [(10.0, 1e4), (3.0, 1e13)])
def test_a_modest_priority_whose_mass_overflows_under_a_large_alpha_is_refused(alpha, priority):
    table = Table(TableConfig(name="t", capacity=4, sampler="prioritized", alpha=alpha))
    with pytest.raises(InvalidPriorityError, match="exceeds float32's range"):
        table.insert({"x": torch.zeros(1)}, priorities=torch.tensor([priority]))
    assert table.size == 0
