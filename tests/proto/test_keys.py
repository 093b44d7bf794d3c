"""Flat keys: flatten/unflatten of nested mappings and TensorDicts, and the keys they refuse."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from replay_proto.keys import KEY_SEPARATOR, check_prefixes, flatten, unflatten

NESTED: dict[str, Any] = {
    "obs": {"pixels": 1, "state": {"pos": 2, "vel": 3}},
    "action": 4,
    "reward": 5,
}
FLAT: dict[str, Any] = {
    "obs.pixels": 1,
    "obs.state.pos": 2,
    "obs.state.vel": 3,
    "action": 4,
    "reward": 5,
}


def test_separator_is_a_dot() -> None:
    assert KEY_SEPARATOR == "."


def test_flatten_joins_nested_paths_with_the_separator() -> None:
    assert flatten(NESTED) == FLAT


def test_flatten_keeps_the_data_key_order_depth_first() -> None:
    assert list(flatten(NESTED)) == list(FLAT)


def test_flatten_of_a_flat_dict_is_an_equal_new_dict() -> None:
    data = {"a": 1, "b": 2}
    out = flatten(data)
    assert out == data
    assert out is not data


def test_flatten_handles_deep_nesting() -> None:
    deep: dict[str, Any] = {"leaf": 7}
    for level in reversed(range(10)):
        deep = {f"l{level}": deep}
    assert flatten(deep) == {".".join(f"l{i}" for i in range(10)) + ".leaf": 7}


def test_flatten_keeps_tensor_leaves_by_identity() -> None:
    leaf = torch.arange(3)
    assert flatten({"obs": {"x": leaf}})["obs.x"] is leaf


def test_unflatten_rebuilds_the_nested_dict() -> None:
    assert unflatten(FLAT) == NESTED


def test_unflatten_then_flatten_round_trips_flat_keys() -> None:
    assert flatten(unflatten(FLAT)) == FLAT


def test_unflatten_keeps_key_order_at_every_level() -> None:
    out = unflatten(FLAT)
    assert list(out) == ["obs", "action", "reward"]
    assert list(out["obs"]) == ["pixels", "state"]
    assert list(out["obs"]["state"]) == ["pos", "vel"]


def test_flatten_round_trip_preserves_order() -> None:
    data = {"z": {"b": 1, "a": 2}, "y": 3, "x": {"d": {"c": 4}}}
    assert list(unflatten(flatten(data))) == ["z", "y", "x"]
    assert unflatten(flatten(data)) == data


def test_flatten_of_an_empty_mapping_is_empty() -> None:
    assert flatten({}) == {}


def test_flatten_accepts_a_tensordict() -> None:
    td = TensorDict({"obs": torch.zeros(4, 3), "action": torch.arange(4)}, batch_size=[4])
    out = flatten(td)
    assert set(out) == {"obs", "action"}
    assert torch.equal(out["action"], torch.arange(4))


def test_flatten_turns_a_nested_tensordict_into_dotted_keys() -> None:
    td = TensorDict(
        {"a": TensorDict({"b": torch.ones(2), "c": {"d": torch.zeros(2)}}, batch_size=[2])},
        batch_size=[2],
    )
    out = flatten(td)
    assert set(out) == {"a.b", "a.c.d"}
    assert torch.equal(out["a.b"], torch.ones(2))


def test_flatten_matches_tensordict_flatten_keys() -> None:
    td = TensorDict({"a": {"b": torch.ones(2)}, "c": torch.zeros(2)}, batch_size=[2])
    assert set(flatten(td)) == set(td.flatten_keys(".").keys())


def test_flatten_accepts_a_tensordict_nested_in_a_dict() -> None:
    inner = TensorDict({"pixels": torch.ones(2, 1)}, batch_size=[2])
    assert set(flatten({"obs": inner, "action": torch.zeros(2)})) == {"obs.pixels", "action"}


@pytest.mark.parametrize("bad", [1, None, ("a",)], ids=["int", "none", "tuple"])
def test_non_string_key_raises_type_error_naming_the_key(bad: Any) -> None:
    with pytest.raises(TypeError, match=re.escape(f"keys must be strings, got {bad!r}")):
        flatten({"ok": 1, bad: 2})


def test_non_string_nested_key_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"keys must be strings, got 3 \(int\)"):
        flatten({"obs": {3: 1}})


def test_empty_key_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"invalid key ''"):
        flatten({"": 1})


def test_empty_nested_key_raises_value_error_naming_its_path() -> None:
    with pytest.raises(ValueError, match=r"invalid key 'obs\.'"):
        flatten({"obs": {"": 1}})


def test_a_dotted_key_is_the_same_path_as_nesting() -> None:
    assert flatten({"obs.pixels": 1, "obs": {"state": 2}}) == {"obs.pixels": 1, "obs.state": 2}
    assert unflatten(flatten({"obs.pixels": 1})) == {"obs": {"pixels": 1}}


def test_the_same_path_given_twice_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"key 'obs\.pixels' is given twice"):
        flatten({"obs.pixels": 1, "obs": {"pixels": 2}})


def test_a_path_that_is_both_a_leaf_and_a_parent_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"key 'obs' is both a value and the parent of 'obs\.a'"):
        flatten({"obs": 1, "obs.a": 2})


@pytest.mark.parametrize("keys", [
    ["a", "a-b", "a.b"],        # "-" sorts between "a" and "a.b"
    ["a", "a+", "a.b.c"],       # a grandchild, with a key sorting between
    ["x.y", "x", "x.y.z"],      # two levels at once
], ids=["sibling-sorts-between", "grandchild", "two-levels"])
def test_a_key_equal_to_another_keys_prefix_is_refused_whatever_sorts_between(keys) -> None:
    with pytest.raises(ValueError, match=r"is both a value and the parent of"):
        flatten({key: 1 for key in keys})
    with pytest.raises(ValueError, match=r"is both a value and the parent of"):
        check_prefixes(keys)


def test_keys_sharing_only_a_text_prefix_are_fine() -> None:
    check_prefixes(["a", "ab", "a-b", "a_b.c", "b.a"])
    assert list(flatten({"a": 1, "ab": 2, "a-b": 3})) == ["a", "ab", "a-b"]


def test_a_dotted_key_with_an_empty_part_raises_value_error_naming_it() -> None:
    for bad in ("obs.", ".obs", "obs..a"):
        with pytest.raises(ValueError, match=rf"invalid key '{re.escape(bad)}'"):
            flatten({bad: 1})


def test_empty_nested_mapping_raises_value_error_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"nested key 'obs' holds an empty mapping"):
        flatten({"obs": {}, "action": 1})


def test_deep_empty_nested_mapping_names_the_full_path() -> None:
    with pytest.raises(ValueError, match=r"nested key 'obs\.state' holds an empty mapping"):
        flatten({"obs": {"state": {}}})


@pytest.mark.parametrize(
    "data, type_name",
    [([1, 2], "list"), (torch.zeros(2), "Tensor"), ("obs", "str"), (None, "NoneType")],
    ids=["list", "tensor", "str", "none"],
)
def test_non_mapping_input_raises_type_error_naming_its_type(data: Any, type_name: str) -> None:
    with pytest.raises(TypeError, match=rf"expected a mapping.*got {type_name}"):
        flatten(data)
