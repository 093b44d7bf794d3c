"""TableConfig validation, the default tables, and the set of tables.

Every bad field raises ConfigError whose message names the table, the field
and the bad value; nothing is silently corrected.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from replay_server.engine.config import MAX_CAPACITY, SamplerKind, TableConfig, default_table_configs
from replay_server.engine.samplers import SAMPLERS
from replay_server.errors import ConfigError, UnknownTableError
from replay_server.engine.schema import FieldSpec
from replay_server.engine.table import Table
from replay_server.engine.table_set import TableSet


def config(**overrides: Any) -> TableConfig:
    fields: dict[str, Any] = {"name": "replay", "capacity": 100}
    fields.update(overrides)
    return TableConfig(**fields)


# ------------------------------------------------------------------------ name


@pytest.mark.parametrize(
    "name",
    ["has space", "", "x" * 129, "a/b", "-leading-dash", "dotted.name", 7, None],
    ids=["space", "empty", "too-long", "slash", "leading-dash", "dot", "int", "none"],
)
def test_bad_name_raises_config_error_naming_it(name: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"table name {name!r} is invalid")):
        config(name=name)


def test_name_with_trailing_newline_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="table name"):
        config(name="replay\n")


@pytest.mark.parametrize("name", ["a", "x" * 128, "replay_v2", "Replay-1", "_private", "0"])
def test_valid_names_are_accepted(name: str) -> None:
    assert config(name=name).name == name


# -------------------------------------------------------------------- capacity


@pytest.mark.parametrize(
    "capacity",
    [0, -1, 10.0, True, MAX_CAPACITY + 1, "100", None],
    ids=["zero", "negative", "float", "bool", "too-large", "str", "none"],
)
def test_bad_capacity_raises_config_error_naming_table_field_and_value(capacity: Any) -> None:
    pattern = rf"table 'replay': capacity must be .*got {re.escape(repr(capacity))}$"
    with pytest.raises(ConfigError, match=pattern):
        config(capacity=capacity)


@pytest.mark.parametrize("capacity", [1, MAX_CAPACITY])
def test_capacity_bounds_are_inclusive(capacity: int) -> None:
    assert config(capacity=capacity).capacity == capacity


# --------------------------------------------------------------------- sampler


@pytest.mark.parametrize("sampler", ["heap", "Uniform", "", 3, None], ids=repr)
def test_unknown_sampler_raises_config_error_listing_the_kinds(sampler: Any) -> None:
    kinds = ", ".join(SAMPLERS)  # the registry's names, in registration order
    pattern = rf"table 'replay': sampler must be one of {kinds}, got {re.escape(repr(sampler))}"
    with pytest.raises(ConfigError, match=pattern):
        config(sampler=sampler)


@pytest.mark.parametrize("kind", list(SamplerKind), ids=lambda k: k.value)
def test_sampler_string_is_coerced_to_sampler_kind(kind: SamplerKind) -> None:
    slice_len = 4 if kind.traits.slices else None
    made = config(sampler=kind.value, slice_len=slice_len)
    assert made.sampler is kind


def test_sampler_defaults_to_uniform() -> None:
    assert config().sampler is SamplerKind.UNIFORM


# ---------------------------------------------------------------- alpha / beta


@pytest.mark.parametrize("field", ["alpha", "beta"])
@pytest.mark.parametrize(
    "value",
    [-0.1, float("nan"), float("inf"), float("-inf"), True, "0.5", None],
    ids=["negative", "nan", "inf", "-inf", "bool", "str", "none"],
)
def test_bad_alpha_or_beta_raises_config_error_naming_table_field_and_value(
    field: str, value: Any
) -> None:
    pattern = rf"table 'replay': {field} must be a finite number >= 0, got {re.escape(repr(value))}"
    with pytest.raises(ConfigError, match=pattern):
        config(sampler="prioritized", **{field: value})


@pytest.mark.parametrize("field", ["alpha", "beta"])
def test_integer_alpha_or_beta_is_stored_as_float(field: str) -> None:
    value = getattr(config(sampler="prioritized", **{field: 1}), field)
    assert type(value) is float and value == 1.0


@pytest.mark.parametrize("field", ["alpha", "beta"])
def test_zero_alpha_or_beta_is_accepted(field: str) -> None:
    assert getattr(config(sampler="prioritized", **{field: 0}), field) == 0.0


# ------------------------------------------------------------------- slice_len


@pytest.mark.parametrize("sampler", ["slice", "prioritized_slice"])
def test_slice_sampler_without_slice_len_raises_config_error(sampler: str) -> None:
    with pytest.raises(ConfigError, match=rf"table 'replay': sampler '{sampler}' needs slice_len"):
        config(sampler=sampler)


@pytest.mark.parametrize("sampler", ["slice", "prioritized_slice"])
@pytest.mark.parametrize(
    "slice_len", [0, -1, 101, 4.0, True], ids=["zero", "negative", "over-capacity", "float", "bool"]
)
def test_bad_slice_len_raises_config_error_naming_table_field_and_value(
    sampler: str, slice_len: Any
) -> None:
    pattern = (
        r"table 'replay': slice_len must be an integer in \[1, capacity=100\], "
        rf"got {re.escape(repr(slice_len))}"
    )
    with pytest.raises(ConfigError, match=pattern):
        config(sampler=sampler, slice_len=slice_len)


@pytest.mark.parametrize("slice_len", [1, 100])
def test_slice_len_bounds_are_inclusive(slice_len: int) -> None:
    assert config(sampler="slice", slice_len=slice_len).slice_len == slice_len


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_slice_len_on_a_row_sampler_raises_config_error_naming_the_sampler(sampler: str) -> None:
    pattern = (
        rf"table 'replay': slice_len=8 is only used by sampler 'slice' or 'prioritized_slice', "
        rf"and sampler is '{sampler}'; remove slice_len or choose sampler 'slice'"
    )
    with pytest.raises(ConfigError, match=pattern):
        config(sampler=sampler, slice_len=8)


# -------------------------------------------------------------- episode keys


@pytest.mark.parametrize("field", ["episode_key", "done_key", "truncated_key"])
@pytest.mark.parametrize("value", ["", None, 3], ids=["empty", "none", "int"])
def test_bad_episode_column_key_raises_config_error_naming_table_field_and_value(
    field: str, value: Any
) -> None:
    pattern = rf"table 'replay': {field} must be a non-empty string, got {re.escape(repr(value))}"
    with pytest.raises(ConfigError, match=pattern):
        config(**{field: value})


def test_episode_key_equal_to_done_key_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="episode_key"):
        config(sampler="slice", slice_len=4, episode_key="done")


def test_episode_end_keys_are_done_then_truncated() -> None:
    assert config(done_key="d", truncated_key="t").episode_end_keys == ("d", "t")


# ------------------------------------------------------------- seed / pinning


@pytest.mark.parametrize("seed", [1.5, "7", True, -1, 2**128],
                         ids=["float", "str", "bool", "negative", "too-large"])
def test_bad_seed_raises_config_error_naming_table_field_and_value(seed: Any) -> None:
    pattern = (rf"table 'replay': seed must be an integer in \[0, 2\*\*128\) or omitted, got "
               rf"{re.escape(repr(seed))}")
    with pytest.raises(ConfigError, match=pattern):
        config(seed=seed)


@pytest.mark.parametrize("pin_memory", ["auto", "true", 1, None], ids=repr)
def test_non_bool_pin_memory_raises_config_error_naming_table_field_and_value(
    pin_memory: Any,
) -> None:
    value = re.escape(repr(pin_memory))
    pattern = rf"table 'replay': pin_memory must be true or false, got {value}"
    with pytest.raises(ConfigError, match=pattern):
        config(pin_memory=pin_memory)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pin_memory_without_accelerator_is_refused_by_the_table() -> None:
    made = config(pin_memory=True, schema={"obs": FieldSpec(torch.float32, (3,))})
    with pytest.raises(ConfigError, match=r"pin_memory is true but no CUDA device is available"):
        Table(made)


# ---------------------------------------------------------------------- schema


def test_schema_value_that_is_not_a_field_spec_raises_config_error_naming_key_and_type() -> None:
    pattern = r"table 'replay': schema\['obs'\] must be a FieldSpec, got dict"
    with pytest.raises(ConfigError, match=pattern):
        config(schema={"obs": {"dtype": "float32", "shape": [3]}})


@pytest.mark.parametrize("schema", [{}, [FieldSpec(torch.float32)]], ids=["empty", "list"])
def test_schema_that_is_not_a_non_empty_mapping_raises_config_error(schema: Any) -> None:
    with pytest.raises(ConfigError, match=r"table 'replay': schema must be a non-empty mapping"):
        config(schema=schema)


def test_declared_schema_is_kept() -> None:
    schema = {"obs": FieldSpec(torch.float32, (3,))}
    assert config(schema=schema).schema == schema


# ---------------------------------------------------------------------- frozen


def test_config_is_frozen() -> None:
    made = config()
    with pytest.raises(AttributeError):
        made.capacity = 5  # type: ignore[misc]


def test_describe_gives_plain_values() -> None:
    described = config(sampler="slice", slice_len=4).describe()
    assert described["sampler"] == "slice"
    assert described["slice_len"] == 4
    assert described["capacity"] == 100


# -------------------------------------------------------------- default tables


def test_default_tables_have_one_table_per_sampler_kind() -> None:
    kinds = [c.sampler for c in default_table_configs()]
    assert sorted(kinds, key=lambda k: k.value) == sorted(SamplerKind, key=lambda k: k.value)


def test_default_table_names_are_unique() -> None:
    names = [c.name for c in default_table_configs()]
    assert len(set(names)) == len(names)


def test_default_tables_take_the_given_capacity() -> None:
    assert {c.capacity for c in default_table_configs(capacity=64)} == {64}


def test_default_tables_build_a_tables_set() -> None:
    assert len(TableSet(default_table_configs(capacity=64))) == len(SamplerKind)


# ---------------------------------------------------------------------- TableSet


def test_duplicate_table_names_raise_config_error_naming_the_name() -> None:
    with pytest.raises(ConfigError, match=r"two tables are named 'replay'"):
        TableSet([config(), config(sampler="prioritized")])


def test_no_tables_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="at least one table"):
        TableSet([])


def test_unknown_table_raises_unknown_table_error_naming_it_and_listing_existing() -> None:
    tables = TableSet([config(name="b"), config(name="a")])
    with pytest.raises(UnknownTableError, match=r"no table named 'missing'; tables: a, b$"):
        tables["missing"]


def test_tables_look_up_by_name() -> None:
    tables = TableSet([config(name="a"), config(name="b")])
    assert tables["b"].name == "b"


def test_tables_keep_config_order() -> None:
    assert TableSet([config(name="b"), config(name="a")]).names == ["b", "a"]
