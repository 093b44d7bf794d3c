"""Turning what callers hand a table into values it can use, or a typed error naming why.

Columns of an insert, priorities, ids and batch sizes are checked and
converted here, before the table takes its lock; the table itself only
orchestrates. Every function raises a
:class:`~replay_server.errors.ReplayServerError` subclass whose message names
the table and the offending key or value.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from replay_proto import inputs
from replay_proto.dtypes import DTYPES
from replay_proto.error_kinds import ErrorKind
from replay_proto.rows import EPISODE_KEY, rows_of
from replay_server.engine.config import TableConfig
from replay_server.engine.readers import NEXT_PREFIX, STEPS_KEY, check_stack_columns
from replay_server.engine.schema import Schema
from replay_server.errors import (
    InvalidArgumentError,
    InvalidIdsError,
    InvalidPriorityError,
    SchemaMismatchError,
)

MAX_BATCH_SIZE = 1 << 24
"""Largest ``batch_size`` a single sample may ask for."""

_LOG_FLOAT32_MAX = math.log(float(torch.finfo(torch.float32).max))
_LOG_FLOAT64_MAX = math.log(float(torch.finfo(torch.float64).max))
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

_STORABLE = frozenset(DTYPES.values())


def columns_of(data: Any, table: str, episode_key: str = EPISODE_KEY,
               device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """An insert's columns as CPU tensors by flat key, or an error naming the problem.

    Rows are what :func:`~replay_proto.rows.rows_of` says (a TensorDict's batch
    dimensions decide; ``[*envs, T]`` batches get ``episode_key`` ids if they lack them).
    Tensors already on ``device`` (a device table's) stay there.
    """
    try:
        flat = rows_of(data, episode_key=episode_key)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"table {table!r}: {exc}") from None
    if not flat:
        raise InvalidArgumentError(f"table {table!r}: insert has no columns")
    columns = {}
    for key, value in flat.items():
        on_device = isinstance(value, torch.Tensor) and device is not None and (
            value.device == device)
        columns[key] = value if on_device else as_tensor(value, f"key {key!r}", table)
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
    with _typed(table):
        return inputs.cpu_tensor(value, what)


def row_count(columns: Mapping[str, torch.Tensor], table: str) -> int:
    """The common leading dimension of ``columns``, or an error listing them."""
    counts = {key: int(col.shape[0]) for key, col in columns.items()}
    if len(set(counts.values())) > 1:
        raise InvalidArgumentError(
            f"table {table!r}: columns have different numbers of rows "
            f"(leading dims): {counts}"
        )
    return next(iter(counts.values()))


def batch_size_of(batch_size: Any, table: str) -> int:
    """``batch_size`` as an int in ``[1, MAX_BATCH_SIZE]``, or InvalidArgumentError."""
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(
        batch_size, (int, np.integer)
    ) or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise InvalidArgumentError(
            f"table {table!r}: batch_size must be an integer in [1, {MAX_BATCH_SIZE}], "
            f"got {batch_size!r}"
        )
    return operator.index(batch_size)


def max_priority(alpha: float) -> float:
    """The largest priority whose sampling mass ``p ** alpha`` fits a float32 sum tree."""
    # Below alpha ~ 0.125 every float64 priority fits (exp would overflow computing the bound).
    if alpha <= 0 or _LOG_FLOAT32_MAX / alpha >= _LOG_FLOAT64_MAX:
        return math.inf
    return math.exp(_LOG_FLOAT32_MAX / alpha)


def priority_values(priorities: Any, table: str, alpha: float) -> np.ndarray:
    """Priorities as float64 numpy (any shape), or an error naming the first bad value.

    Raises:
        InvalidPriorityError: not real numbers, not finite and >= 0
            (:func:`replay_proto.inputs.priority_values`, the client's rules too), or so
            large that ``p ** alpha`` overflows float32.
    """
    with _typed(table):
        values = inputs.priority_values(priorities)
    check_bound(values, table, alpha)
    return values


def check_bound(values: np.ndarray, table: str, alpha: float) -> None:
    """Refuse priorities whose sampling mass ``p ** alpha`` overflows float32.

    Raises:
        InvalidPriorityError: naming the largest priority and ``alpha``.
    """
    top = float(values.max()) if values.size else 0.0
    if top > max_priority(alpha):
        raise InvalidPriorityError(
            f"table {table!r}: priority {top} is too large: its sampling mass p**alpha "
            f"(alpha={alpha}) exceeds float32's range"
        )


def id_values(ids: Any, table: str) -> np.ndarray:
    """Ids as int64 numpy (any shape), or InvalidIdsError
    (:func:`replay_proto.inputs.id_values`)."""
    with _typed(table):
        return inputs.id_values(ids)


def update_values(ids: Any, priorities: Any, table: str) -> tuple[np.ndarray, np.ndarray]:
    """A priority update as int64 ids and float64 priorities in the ids' shape, or the typed
    error naming ``table`` (:func:`replay_proto.inputs.update_values`; the priorities'
    bound for ``alpha`` is the table's to check when it applies them)."""
    with _typed(table):
        return inputs.update_values(ids, priorities)


@contextmanager
def _typed(table: str) -> Iterator[None]:
    """The server's typed error, naming ``table``, for an input the shared rules refuse."""
    try:
        yield
    except inputs.InputError as exc:
        raise _BY_KIND[exc.kind](f"table {table!r}: {exc}") from None


_BY_KIND: dict[ErrorKind, type[InvalidArgumentError]] = {
    ErrorKind.INVALID_ARGUMENT: InvalidArgumentError,
    ErrorKind.INVALID_IDS: InvalidIdsError,
    ErrorKind.INVALID_PRIORITY: InvalidPriorityError,
}


def check_sampler_columns(config: TableConfig, schema: Schema) -> None:
    """Slice samplers and n-step tables need an integer episode column and bool end columns,
    one value per row (end flags shaped ``[1]`` per row, as TorchRL's ``done``, count as one
    value); n-step tables also a real reward per row and ``next.*`` columns to bootstrap from.

    Raises:
        SchemaMismatchError: naming the column and what it holds.
    """
    if config.n_step > 1:
        _check_n_step_columns(config, schema)
    if config.frame_stack_key is not None:
        check_stack_columns(config.name, config.frame_stack_key, schema)
    missing = [key for key in config.compress_keys or () if key not in schema]
    if missing:
        raise SchemaMismatchError(f"table {config.name!r}: compress_keys names {missing}, which "
                                  f"the schema lacks; it has {sorted(schema)}")
    if not (config.sampler.traits.episodes or config.n_step > 1 or config.frame_stack_key):
        return
    key = config.episode_key
    spec = schema.get(key)
    if spec is None or spec.dtype not in _INTEGER_DTYPES or spec.shape != ():
        got = "no such key" if spec is None else spec.describe()
        raise SchemaMismatchError(
            f"table {config.name!r}: sampler {config.sampler.value!r} needs key "
            f"{key!r} holding one integer episode id per row (e.g. int64[]), got {got}"
        )
    for key in config.episode_end_keys:
        spec = schema.get(key)
        if spec is not None and (spec.dtype != torch.bool or spec.shape not in ((), (1,))):
            raise SchemaMismatchError(
                f"table {config.name!r}: key {key!r} marks episode ends and must hold one "
                f"bool per row (bool[], or bool[1] as TorchRL's flags), got {spec.describe()}"
            )


def _check_n_step_columns(config: TableConfig, schema: Schema) -> None:
    """What an n-step table needs besides episodes: see :func:`check_sampler_columns`."""
    where = f"table {config.name!r}: n_step={config.n_step}"
    spec = schema.get(config.reward_key)
    if spec is None or not spec.dtype.is_floating_point or spec.shape not in ((), (1,)):
        got = "no such key" if spec is None else spec.describe()
        raise SchemaMismatchError(f"{where} needs key {config.reward_key!r} (reward_key) holding "
                                  f"one float reward per row, got {got}")
    if not any(key.startswith(NEXT_PREFIX) for key in schema):
        raise SchemaMismatchError(
            f"{where} needs the bootstrap observation in columns under 'next' (e.g. "
            f"'next.obs'); the schema has {sorted(schema)}")
    if STEPS_KEY in schema or any(key.startswith(STEPS_KEY + ".") for key in schema):
        raise SchemaMismatchError(f"{where} returns column {STEPS_KEY!r}, which the schema "
                                  f"already has; rename it")
