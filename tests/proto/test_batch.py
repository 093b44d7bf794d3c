"""SampleBatch: batch size and the TensorDict view, for row and slice samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from replay_proto.batch import SampleBatch

B, L = 4, 5


def row_batch() -> SampleBatch:
    return SampleBatch(
        data={"obs": {"pixels": torch.zeros(B, 2, 2), "state": torch.ones(B, 3)},
              "action": torch.arange(B)},
        ids=torch.arange(B, dtype=torch.int64),
        weights=torch.ones(B, dtype=torch.float32),
        probabilities=torch.full((B,), 0.25, dtype=torch.float64),
    )


def slice_batch() -> SampleBatch:
    return SampleBatch(
        data={"obs": torch.zeros(B, L, 3), "done": torch.zeros(B, L, dtype=torch.bool)},
        ids=torch.arange(B * L, dtype=torch.int64).reshape(B, L),
        weights=torch.ones(B, dtype=torch.float32),
        probabilities=torch.full((B,), 0.25, dtype=torch.float64),
    )


def test_batch_size_of_row_sample_is_number_of_ids() -> None:
    assert row_batch().batch_size == B


def test_batch_size_of_slice_sample_is_number_of_slices() -> None:
    assert slice_batch().batch_size == B


def test_batch_size_is_a_python_int() -> None:
    assert type(row_batch().batch_size) is int


def test_to_tensordict_of_row_sample_has_batch_dims_b() -> None:
    td = row_batch().to_tensordict()
    assert isinstance(td, TensorDict)
    assert td.batch_size == torch.Size([B])


def test_to_tensordict_of_slice_sample_has_batch_dims_b_l() -> None:
    assert slice_batch().to_tensordict().batch_size == torch.Size([B, L])


def test_to_tensordict_keeps_nested_keys() -> None:
    td = row_batch().to_tensordict()
    assert td["obs", "pixels"].shape == (B, 2, 2)
    assert torch.equal(td["obs", "state"], torch.ones(B, 3))


def test_to_tensordict_keeps_values() -> None:
    assert torch.equal(row_batch().to_tensordict()["action"], torch.arange(B))


def test_sample_batch_is_frozen() -> None:
    batch = row_batch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.ids = torch.zeros(1)  # type: ignore[misc]
