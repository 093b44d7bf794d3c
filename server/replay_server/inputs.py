"""Turning what a caller inserts into columns a table can store (or a typed error naming why)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.dtypes import DTYPES
from replay_proto.keys import flatten
from replay_server.errors import InvalidArgumentError, SchemaMismatchError

_STORABLE = frozenset(DTYPES.values())


def columns_of(data: Any, table: str) -> dict[str, torch.Tensor]:
    """An insert's columns as CPU tensors by flat key, or an error naming the problem."""
    try:
        flat = flatten(data)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"table {table!r}: {exc}") from None
    if not flat:
        raise InvalidArgumentError(f"table {table!r}: insert has no columns")
    columns = {}
    for key, value in flat.items():
        columns[key] = as_tensor(value, f"key {key!r}", table)
        if columns[key].dtype not in _STORABLE:
            raise SchemaMismatchError(
                f"table {table!r}: key {key!r} has dtype {columns[key].dtype}, which a "
                f"table cannot store; supported dtypes: {', '.join(DTYPES)}"
            )
        if columns[key].dim() == 0:
            raise InvalidArgumentError(
                f"table {table!r}: key {key!r} is a scalar; every column needs a "
                f"leading dimension of rows (use shape [1] for one row)"
            )
    return columns


def as_tensor(value: Any, what: str, table: str) -> torch.Tensor:
    """``value`` as a CPU tensor (numpy arrays and sequences converted), or an error naming ``what``."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else value.cpu()
    try:
        array = np.asarray(value)
        if any(stride < 0 for stride in array.strides):  # torch refuses reversed views
            array = array.copy()
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"table {table!r}: {what} is not a tensor or array "
            f"({type(value).__name__}): {exc}"
        ) from None


def row_count(columns: Mapping[str, torch.Tensor], table: str) -> int:
    """The common leading dimension of ``columns``, or an error listing them."""
    counts = {key: int(col.shape[0]) for key, col in columns.items()}
    if len(set(counts.values())) > 1:
        raise InvalidArgumentError(
            f"table {table!r}: columns have different numbers of rows "
            f"(leading dims): {counts}"
        )
    return next(iter(counts.values()))
