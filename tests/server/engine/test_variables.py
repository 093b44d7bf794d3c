"""VariableStore: versions, copies, refused input that changes nothing, the byte budget, state."""

from __future__ import annotations

import pytest
import torch

from replay_proto.codec import frame
from replay_proto.variable_codec import decode_publish_packed, publish_parts
from replay_server.engine.variables import VariableStore
from replay_server.errors import (
    InvalidVariableError,
    MalformedStateError,
    UnknownVariableError,
    VariableBudgetError,
)


def encode_publish(name: str, tensors: dict[str, torch.Tensor]) -> bytes:
    """A whole (unary) PublishRequest carrying ``tensors``."""
    return frame(*publish_parts(name, tensors))


def policy(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"net.0.weight": torch.full((4, 3), value), "net.0.bias": torch.zeros(4),
            "steps": torch.tensor(7, dtype=torch.int64)}


def test_versions_count_up_per_name_and_only_the_newest_is_kept() -> None:
    store = VariableStore(1 << 20)
    assert store.publish("policy", policy(1.0)).version == 1
    assert store.publish("policy", policy(2.0)).version == 2
    assert store.publish("critic", policy(3.0)).version == 1
    newest = store.get("policy")
    assert newest.version == 2 and (newest.tensors["net.0.weight"] == 2.0).all()
    assert store.version("policy") == 2 and store.version("never") == 0


def test_publish_stores_a_private_copy() -> None:
    store = VariableStore(1 << 20)
    state = policy(1.0)
    store.publish("policy", state)
    state["net.0.weight"].fill_(9.0)
    assert (store.get("policy").tensors["net.0.weight"] == 1.0).all()


def test_unknown_name_is_refused_naming_it() -> None:
    with pytest.raises(UnknownVariableError, match="'nope'"):
        VariableStore(1 << 20).get("nope")


@pytest.mark.parametrize("name, state, match", [
    ("", policy(), "name '' is invalid"),
    ("/abs", policy(), "is invalid"),
    ("policy", {}, "at least one tensor"),
    ("policy", {"w": torch.zeros(2), "lr": 0.1}, "key 'lr' holds a float; variables hold tensors"),
    ("policy", {"opt": {"state": torch.zeros(1)}}, "key 'opt' holds a dict"),
    ("policy", {"": torch.zeros(1)}, "non-empty strings"),
    ("policy", {"z": torch.zeros(2, dtype=torch.complex64)}, "key 'z' has dtype torch.complex64"),
    ("policy", {"s": torch.zeros(3).to_sparse()}, "key 's'.*sparse"),
    ("policy", [torch.zeros(1)], "got list"),
    ("policy", {"deep": torch.zeros([1] * 33)}, "33 dimensions, at most 32"),
    ("policy", {"k" * 1025: torch.zeros(1)}, "1025 characters, at most 1024"),
    ("x" * 129, policy(), "is invalid"),
])
def test_bad_input_is_refused_and_changes_nothing(name, state, match) -> None:
    store = VariableStore(1 << 20)
    store.publish("policy", policy(1.0))
    with pytest.raises(InvalidVariableError, match=match):
        store.publish(name, state)
    assert store.version("policy") == 1 and (store.get("policy").tensors["net.0.bias"] == 0).all()


def test_budget_is_refused_clearly_and_keeps_what_was_stored() -> None:
    one = {"w": torch.zeros(100, dtype=torch.uint8)}
    charged = VariableStore(1 << 20).publish("a", one).nbytes
    assert charged > 100
    store = VariableStore(2 * charged)
    store.publish("a", one)
    store.publish("b", one)
    with pytest.raises(VariableBudgetError, match=r"'c'.*over server.variables_max_mb"):
        store.publish("c", one)
    store.publish("a", one)  # replacing a name only counts the difference
    assert store.nbytes == 2 * charged and store.names() == ["a", "b"]
    with pytest.raises(VariableBudgetError):
        store.publish("a", {"w": torch.zeros(101, dtype=torch.uint8)})
    assert store.get("a").version == 2


def test_state_dict_round_trip_keeps_versions_and_tensors() -> None:
    store = VariableStore(1 << 20)
    store.publish("policy", policy(1.0))
    store.publish("policy", {**policy(2.0), "half": torch.ones(2, dtype=torch.bfloat16)})
    restored = VariableStore(1 << 20)
    restored.load_state_dict(store.state_dict())
    got = restored.get("policy")
    assert got.version == 2 and got.tensors.keys() == store.get("policy").tensors.keys()
    assert got.tensors["half"].dtype == torch.bfloat16
    assert restored.publish("policy", policy()).version == 3
    assert restored.nbytes == store.nbytes + (restored.get("policy").nbytes
                                              - store.get("policy").nbytes)


def test_malformed_state_is_refused_and_changes_nothing() -> None:
    store = VariableStore(1 << 20)
    store.publish("policy", policy())
    for bad in ({"version": 2, "variables": []},
                {"version": 1, "variables": [{"name": "x", "version": 1, "keys": ["a"],
                                              "tensors": []}]},
                {"version": 1}):
        with pytest.raises(MalformedStateError):
            store.load_state_dict(bad)
    assert store.version("policy") == 1


def test_a_publish_from_the_wire_is_stored_in_one_copy_and_checked_like_tensors() -> None:
    store = VariableStore(1 << 20)
    name, specs, payload = decode_publish_packed(encode_publish("policy", policy(3.0)))
    variable = store.publish_packed(name, specs, payload)
    assert variable.keys == 3 and variable.data.nbytes == 12 * 4 + 4 * 4 + 8
    assert (store.get("policy").tensors["net.0.weight"] == 3.0).all()
    assert store.get("policy").tensors["steps"].item() == 7
    with pytest.raises(InvalidVariableError, match="payload has"):
        store.publish_packed("policy", specs, payload[:-1])
    assert store.version("policy") == 1


def test_a_variable_is_charged_its_bytes_and_specs_not_a_guess_per_key() -> None:
    many = {f"layer{i}.weight": torch.zeros(1) for i in range(1000)}
    variable = VariableStore(1 << 30).publish("many", many)
    assert variable.nbytes >= 1000 * 4 + sum(len(k) for k in many)
    assert variable.nbytes == variable.data.nbytes + len(variable.layout) + 1024


def test_an_unknown_name_lists_only_a_few_of_the_names_stored() -> None:
    store = VariableStore(1 << 30)
    for i in range(100):
        store.publish(f"v{i:03d}", {"w": torch.zeros(1)})
    with pytest.raises(UnknownVariableError) as info:
        store.get("nope")
    assert "v019" in str(info.value) and "v020" not in str(info.value)
    assert "(100 in all)" in str(info.value)
