"""``is_int`` / ``is_real``: the one "an integer (or number) but not a bool" check of both sides."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay_proto.scalars import is_int, is_real


@pytest.mark.parametrize("value", [0, -3, 2**70])
def test_python_ints_are_ints_and_reals(value: int) -> None:
    assert is_int(value) and is_real(value) and is_int(value, numpy=True)


@pytest.mark.parametrize("value", [True, False, np.bool_(True)])
def test_bools_are_neither(value: object) -> None:
    assert not is_int(value) and not is_int(value, numpy=True)
    assert not is_real(value) and not is_real(value, numpy=True)


@pytest.mark.parametrize("value", [1.0, math.inf, "1", None, [1]])
def test_anything_else_is_no_int(value: object) -> None:
    assert not is_int(value) and not is_int(value, numpy=True)


def test_numpy_scalars_count_only_when_asked() -> None:
    assert not is_int(np.int64(3)) and is_int(np.int64(3), numpy=True)
    assert not is_real(np.int32(3)) and is_real(np.int32(3), numpy=True)
    assert is_real(np.float64(0.5))  # a Python float subclass
    assert not is_real(np.float32(0.5)) and is_real(np.float32(0.5), numpy=True)
    assert is_real(1.5) and is_real(math.inf) and not is_real("1.5")
