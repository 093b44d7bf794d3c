"""statecodec: nested states round-trip through JSON + one blob, with no code run on load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from replay_server.checkpoint.statecodec import StateFormatError, decode_state, encode_state


def _round_trip(state):
    tree, pieces = encode_state(state)
    blob = b"".join(bytes(p) for p in pieces)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # strict JSON survives
    return decode_state(tree, blob)


def test_nested_tensors_arrays_and_plain_values_round_trip() -> None:
    state = {
        "version": 1,
        "name": "t",
        "none": None,
        "flag": True,
        "ratio": 0.25,
        "inf": math.inf,
        "big": 2**100,
        "list": [1, "two", [3.0]],
        "tuple": (4, 5),
        "tensors": {
            "f32": torch.randn(3, 2),
            "bf16": torch.randn(4).to(torch.bfloat16),
            "bool": torch.tensor([True, False]),
            "empty": torch.zeros(0, 5, dtype=torch.int64),
            "scalar": torch.tensor(7, dtype=torch.int16),
            "strided": torch.arange(10)[::2],
        },
        "numpy": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "numpy_scalar": np.float32(1.5),
    }
    got = _round_trip(state)
    assert got["version"] == 1 and got["name"] == "t" and got["none"] is None
    assert got["flag"] is True and got["ratio"] == 0.25 and got["inf"] == math.inf
    assert got["big"] == 2**100
    assert got["list"] == [1, "two", [3.0]] and got["tuple"] == [4, 5]
    for key, tensor in state["tensors"].items():
        assert isinstance(got["tensors"][key], torch.Tensor), key
        assert got["tensors"][key].dtype == tensor.dtype, key
        assert torch.equal(got["tensors"][key], tensor), key
    assert isinstance(got["numpy"], np.ndarray) and got["numpy"].dtype == np.uint32
    assert np.array_equal(got["numpy"], state["numpy"])
    assert got["numpy_scalar"] == 1.5


def test_nan_round_trips() -> None:
    assert math.isnan(_round_trip({"x": math.nan})["x"])


def test_arrays_are_aligned_in_the_blob() -> None:
    tree, pieces = encode_state({"a": torch.zeros(3, dtype=torch.uint8), "b": torch.ones(5)})
    assert tree["b"]["$tensor"]["offset"] % 64 == 0
    assert sum(p.size for p in pieces) % 64 == 0


@pytest.mark.parametrize(("state", "fragment"), [
    ({"x": object()}, "state.x: cannot save a value of type object"),
    ({"x": {1: 2}}, "state.x: keys must be strings"),
    ({"$tensor": 1}, "not starting with '$'"),
    ({"x": np.array(["a"])}, "state.x: cannot save a numpy array of dtype <U1"),
    ({"x": [1, {2.0}]}, "state.x[1]: cannot save a value of type set"),
])
def test_unsavable_values_are_refused_naming_the_path(state, fragment) -> None:
    with pytest.raises(StateFormatError, match=r".*") as info:
        encode_state(state)
    assert fragment in str(info.value)


def test_decoded_arrays_do_not_share_the_blob() -> None:
    tree, pieces = encode_state({"x": torch.arange(4)})
    blob = bytearray(b"".join(bytes(p) for p in pieces))
    got = decode_state(tree, blob)
    blob[:] = bytes(len(blob))
    assert got["x"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(("tree", "fragment"), [
    ({"x": {"$tensor": {"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}}},
     "does not fit"),  # the blob has 8 bytes
    ({"x": {"$tensor": {"dtype": "float32", "shape": [3], "offset": 0, "nbytes": 8}}},
     "does not fit"),
    ({"x": {"$tensor": {"dtype": "float32", "shape": [2], "offset": -8, "nbytes": 8}}},
     "does not fit"),
    ({"x": {"$tensor": {"dtype": "complex64", "shape": [1], "offset": 0, "nbytes": 8}}},
     "bad tensor dtype"),
    ({"x": {"$tensor": {"dtype": "float32", "offset": 0, "nbytes": 8}}},
     "malformed array reference"),
    ({"x": {"$ndarray": {"dtype": "|O", "shape": [1], "offset": 0, "nbytes": 8}}},
     "not allowed"),
    ({"x": {"$float": "1e400"}}, "bad float"),
])
def test_malformed_references_are_refused_naming_the_path(tree, fragment) -> None:
    with pytest.raises(StateFormatError) as info:
        decode_state(tree, bytes(8))
    assert "state.x" in str(info.value) and fragment in str(info.value)
