"""replay_proto.inputs' priority update: the ids' shape is kept (a slice batch's ``[B, L]``
reaches a table that mixes priorities per slice as it was sampled), and a priorities shape
other than the ids' is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_proto.inputs import ErrorKind, InputError, update_values


def test_a_priority_update_keeps_the_ids_shape() -> None:
    ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    id_values, values = update_values(ids, torch.full((3, 4), 0.5, dtype=torch.float32))
    assert id_values.shape == values.shape == (3, 4)
    assert id_values.dtype == np.int64 and values.dtype == np.float64
    assert np.array_equal(id_values, ids.numpy()) and (values == 0.5).all()
    flat_ids, flat_values = update_values([1, 2], [0.1, 0.2])
    assert flat_ids.shape == flat_values.shape == (2,)


def test_priorities_of_another_shape_than_the_ids_are_refused() -> None:
    with pytest.raises(InputError, match=r"same shape as ids \[3, 4\]") as caught:
        update_values(torch.zeros((3, 4), dtype=torch.int64), torch.zeros(12))
    assert caught.value.kind == ErrorKind.INVALID_PRIORITY
