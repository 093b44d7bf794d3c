"""The client's one normalisation of an insert (replay_client.arguments.insert_columns): what
crosses the wire is flat CPU tensors of stored dtypes and float64 priorities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_client.arguments import insert_columns
from replay_client.errors import InvalidArgumentError, InvalidPriorityError


def test_columns_become_flat_cpu_tensors_and_ready_ones_pass_uncopied() -> None:
    ready = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    strided = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]  # not contiguous
    columns, priorities = insert_columns({"obs": {"state": ready}, "k": strided})
    assert list(columns) == ["obs.state", "k"] and priorities is None
    assert columns["obs.state"].data_ptr() == ready.data_ptr()  # no copy
    assert columns["k"].dtype == torch.int16 and columns["k"].tolist() == strided.tolist()


def test_priorities_become_float64_one_per_row() -> None:
    _, priorities = insert_columns({"x": torch.zeros(3)}, [1, 2, 3])
    assert priorities is not None and priorities.dtype == torch.float64
    assert priorities.tolist() == [1.0, 2.0, 3.0]


def test_bad_inserts_raise_typed_errors_naming_what_was_wrong() -> None:
    with pytest.raises(InvalidArgumentError, match="key 'z'.*not supported"):
        insert_columns({"x": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(InvalidArgumentError, match="mapping"):
        insert_columns([torch.zeros(2)])
    with pytest.raises(InvalidPriorityError, match=r"shape \[2\] \(one per row\), got \[3\]"):
        insert_columns({"x": torch.zeros(2)}, torch.ones(3))
