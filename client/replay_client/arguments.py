"""Checks and conversions of what callers hand the client: tensors, ids, priorities.

Everything here runs before a request is sent, so a bad argument is refused
with a typed error naming it and nothing reaches the server.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_client.errors import InvalidArgumentError, InvalidIdsError, InvalidPriorityError


def check_int(name: str, value: Any, low: int) -> None:
    """Refuse ``value`` unless it is an integer (not a bool) of at least ``low``.

    Raises:
        InvalidArgumentError: naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {value!r}")


def id_array(ids: Any) -> np.ndarray:
    """``ids`` as an int64 array of their own shape (a tensor, array or list).

    Raises:
        InvalidIdsError: they are not int64.
    """
    array = np.asarray(ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids)
    if array.dtype != np.int64:
        raise InvalidIdsError(
            f"ids must be int64 (as returned by insert and sample), got dtype {array.dtype}"
        )
    return array


def update_arrays(ids: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validated, contiguous copies: int64 ids and float64 priorities, in the ids' shape (a
    slice batch's ``[B, slice_len]`` crosses the wire as it is: a table that mixes
    priorities per slice takes whole slices)."""
    ids = id_array(ids)
    values = tensor_of(priorities, "priorities")
    if tuple(values.shape) != ids.shape:
        raise InvalidPriorityError(
            f"priorities must have the same shape as ids {list(ids.shape)}, "
            f"got {list(values.shape)}"
        )
    if values.dtype == torch.bool or values.is_complex():
        raise InvalidPriorityError(f"priorities must be real numbers, got {values.dtype}")
    array = values.to(torch.float64).numpy().reshape(-1)
    bad = ~(np.isfinite(array) & (array >= 0))
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise InvalidPriorityError(
            f"priorities must be finite and >= 0; {int(bad.sum())} are not "
            f"(first at index {first}: {array[first]})"
        )
    return np.array(ids, dtype=np.int64), np.array(array).reshape(ids.shape)


def tensor_of(value: Any, what: str) -> torch.Tensor:
    """``value`` (a tensor, array or nested list) as a CPU tensor; ``what`` names it in errors."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        array = np.asarray(value)
        if any(stride < 0 for stride in array.strides):
            array = array.copy()
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(f"{what} is not a tensor or array: {exc}") from None
