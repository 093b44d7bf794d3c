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


def test_to_tensordict_names_ids_index_and_weights_weight_as_torchrl_does() -> None:
    batch = row_batch()
    td = row_batch().to_tensordict()
    assert torch.equal(td["index"], batch.ids) and td["index"].dtype == torch.int64
    assert torch.equal(td["_weight"], batch.weights) and td["_weight"].dtype == torch.float32


def test_to_tensordict_of_slice_sample_gives_each_step_its_slices_weight() -> None:
    batch = slice_batch()
    batch = SampleBatch(batch.data, batch.ids, torch.arange(B, dtype=torch.float32),
                        batch.probabilities)
    td = batch.to_tensordict()
    assert td["index"].shape == (B, L) and torch.equal(td["index"], batch.ids)
    assert td["_weight"].shape == (B, L)
    assert (td["_weight"] == torch.arange(B, dtype=torch.float32)[:, None]).all()


def test_to_tensordict_shares_memory_with_the_batch() -> None:
    batch = row_batch()
    td = batch.to_tensordict()
    assert td["obs", "state"].data_ptr() == batch.columns["obs.state"].data_ptr()
    assert td["index"].data_ptr() == batch.ids.data_ptr()


def test_to_tensordict_refuses_a_column_named_like_an_extra() -> None:
    batch = SampleBatch({"index": torch.zeros(B)}, torch.arange(B), torch.ones(B),
                        torch.ones(B, dtype=torch.float64))
    with pytest.raises(ValueError, match="column named 'index'"):
        batch.to_tensordict()


def test_to_tensordict_works_as_an_unbound_transform() -> None:
    transform = SampleBatch.to_tensordict
    assert set(transform(row_batch()).keys()) == {"obs", "action", "index", "_weight"}


def test_to_tensordict_weight_key_can_be_torchrls_current_name() -> None:
    td = row_batch().to_tensordict("priority_weight")
    assert "priority_weight" in td.keys() and "_weight" not in td.keys()
