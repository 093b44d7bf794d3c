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

from replay_client.errors import InvalidArgumentError, InvalidPriorityError, error_of
from replay_feed.credits import PriorityUpdate
from replay_proto import inputs
from replay_proto.dtypes import dtype_name
from replay_proto.rows import rows_of
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


def insert_columns(data: Any, priorities: Any = None
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """An insert's columns and priorities as they cross the wire: the client's one
    normalisation of them (the server's is its engine's, ``engine/insert_rows.py``).

    Columns: flat key -> CPU tensor of a dtype tables store, rows along the
    leading dim (:func:`~replay_proto.rows.rows_of`: a TensorDict's batch dims
    decide); the wire encoder takes their bytes (a strided view's made
    contiguous there, its one copy). Priorities: float64 ``[rows]``. Tensors
    that already are so pass through uncopied (a writer's batches).

    Raises:
        InvalidArgumentError: not a mapping (or TensorDict) of tensors or arrays, or a
            dtype no table stores (the message names the key).
        InvalidPriorityError: priorities are not one per row.
    """
    try:
        flat = rows_of(data)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(str(exc)) from None
    columns = {}
    for key, value in flat.items():
        tensor = tensor_of(value, f"key {key!r}")
        try:
            dtype_name(tensor.dtype)
        except ValueError as exc:
            raise InvalidArgumentError(f"key {key!r}: {exc}") from None
        columns[key] = tensor
    if priorities is None:
        return columns, None
    values = tensor_of(priorities, "priorities")
    rows = next(iter(columns.values())).shape[0] if columns else 0
    if tuple(values.shape) != (rows,):
        raise InvalidPriorityError(
            f"priorities must have shape [{rows}] (one per row), got {list(values.shape)}")
    return columns, values.to(torch.float64)


def tensor_of(value: Any, what: str) -> torch.Tensor:
    """``value`` (a tensor, array or nested list) as a CPU tensor; ``what`` names it in errors.

    Raises:
        InvalidArgumentError: not convertible to a tensor.
    """
    try:  # inline, not _typed(): this runs for every column of every insert
        return inputs.cpu_tensor(value, what)
    except inputs.InputError as exc:
        raise error_of(exc.kind, str(exc)) from None


@contextmanager
def _typed() -> Iterator[None]:
    """The client's typed error for a refused input (its kind's class)."""
    try:
        yield
    except inputs.InputError as exc:
        raise error_of(exc.kind, str(exc)) from None
