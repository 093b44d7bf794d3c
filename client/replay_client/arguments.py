"""Checks and conversions of what callers hand the client: tensors, ids, priorities.

Everything here runs before a request is sent, so a bad argument is refused
with a typed error naming it and nothing reaches the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from replay_client.errors import InvalidArgumentError, error_of
from replay_feed.credits import PriorityUpdate
from replay_proto import inputs
from replay_proto.scalars import is_int


def check_int(name: str, value: Any, low: int) -> None:
    """Refuse ``value`` unless it is an integer (not a bool) of at least ``low``.

    Raises:
        InvalidArgumentError: naming ``name`` and the value.
    """
    if not is_int(value, numpy=True) or value < low:
        raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {value!r}")


def id_array(ids: Any) -> np.ndarray:
    """``ids`` as an int64 array of their own shape (a tensor, array or list).

    Raises:
        InvalidIdsError: they are not int64.
    """
    with _typed():
        return inputs.id_values(ids)


def update_arrays(ids: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validated, contiguous copies: int64 ids and float64 priorities in the ids' shape
    (:func:`replay_proto.inputs.update_values`, the rules the server applies; a slice
    batch's ``[B, slice_len]`` crosses the wire as it is).

    Raises:
        InvalidIdsError, InvalidPriorityError, InvalidArgumentError: naming what was wrong.
    """
    with _typed():
        return inputs.update_values(ids, priorities)


def priority_update(ids: Any, priorities: Any) -> PriorityUpdate:
    """A stream's priority update, checked as :func:`update_arrays` checks it."""
    id_values, values = update_arrays(ids, priorities)
    return PriorityUpdate(id_values, values)


def tensor_of(value: Any, what: str) -> torch.Tensor:
    """``value`` (a tensor, array or nested list) as a CPU tensor; ``what`` names it in errors.

    Raises:
        InvalidArgumentError: not convertible to a tensor.
    """
    with _typed():
        return inputs.cpu_tensor(value, what)


@contextmanager
def _typed() -> Iterator[None]:
    """The client's typed error for a refused input (its kind's class)."""
    try:
        yield
    except inputs.InputError as exc:
        raise error_of(exc.kind, str(exc)) from None
