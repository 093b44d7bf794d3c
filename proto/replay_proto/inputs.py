"""What callers hand either side, converted and checked by one set of rules: tensors, ids, priorities.

The client checks an insert's or an update's arguments before it sends them;
the server checks what arrives, and what an in-process learner hands a table.
Both use these functions, so the two sides cannot drift apart on what a
valid id or priority is. A refusal is an :class:`InputError` whose ``kind``
(an :class:`~replay_proto.error_kinds.ErrorKind`) picks the typed error each
side raises in its own hierarchy; messages name the argument and the value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_proto.error_kinds import ErrorKind


class InputError(ValueError):
    """A caller's value refused; ``kind`` is one of ``INVALID_ARGUMENT``, ``INVALID_IDS``
    and ``INVALID_PRIORITY`` (each side raises its class of that kind)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def cpu_tensor(value: Any, what: str) -> torch.Tensor:
    """``value`` (a tensor, array or nested list) as a CPU tensor; ``what`` names it in errors.

    Raises:
        InputError: ``INVALID_ARGUMENT``: not convertible to a tensor.
    """
    if isinstance(value, torch.Tensor):
        return value.detach() if value.device.type == "cpu" else value.detach().cpu()
    try:
        array = np.asarray(value)
        if any(stride < 0 for stride in array.strides):  # torch refuses reversed views
            array = array.copy()
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(ErrorKind.INVALID_ARGUMENT,
                         f"{what} is not a tensor or array ({type(value).__name__}): "
                         f"{exc}") from None


def id_values(ids: Any) -> np.ndarray:
    """``ids`` as int64 numpy of their own shape (a view where they already are).

    Raises:
        InputError: ``INVALID_IDS``: not int64 (as ``insert`` and ``sample`` return them).
    """
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64:
        return ids
    tensor = cpu_tensor(ids, "ids")  # a tensor's dtype is named as torch names it
    if tensor.dtype != torch.int64:
        raise InputError(ErrorKind.INVALID_IDS, f"ids must be int64 (as returned by insert and "
                                                f"sample), got dtype {tensor.dtype}")
    return tensor.numpy()


def priority_values(priorities: Any) -> np.ndarray:
    """Priorities as float64 numpy of their own shape (a view where they already are).

    Raises:
        InputError: ``INVALID_PRIORITY``: not real numbers, or not finite and >= 0
            (the message names how many and the first); ``INVALID_ARGUMENT``: not a
            tensor or array.
    """
    if isinstance(priorities, np.ndarray) and priorities.dtype == np.float64:
        values = priorities  # what the service decodes: no conversion
    else:
        tensor = cpu_tensor(priorities, "priorities")
        if tensor.dtype == torch.bool or tensor.is_complex():
            raise InputError(ErrorKind.INVALID_PRIORITY,
                             f"priorities must be real numbers, got dtype {tensor.dtype}")
        values = tensor.numpy().astype(np.float64)
    # NaN fails `>= 0`, +inf fails `< inf`: two passes over the values, not four.
    if values.size and not ((values >= 0).all() and float(values.max()) < np.inf):
        where = np.flatnonzero(~(np.isfinite(values) & (values >= 0)))
        first = int(where[0])
        raise InputError(ErrorKind.INVALID_PRIORITY,
                         f"priorities must be finite and >= 0; {where.size} are not (first at "
                         f"index {first}: {float(values.reshape(-1)[first])})")
    return values


def update_values(ids: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """A priority update as flat, contiguous copies: int64 ids and float64 priorities of one shape.

    Raises:
        InputError: ``INVALID_IDS``, ``INVALID_PRIORITY`` (also for a shape that is
            not the ids'), or ``INVALID_ARGUMENT``.
    """
    id_array = id_values(ids)
    tensor = cpu_tensor(priorities, "priorities")
    if tuple(tensor.shape) != id_array.shape:
        raise InputError(ErrorKind.INVALID_PRIORITY,
                         f"priorities must have the same shape as ids {list(id_array.shape)}, "
                         f"got {list(tensor.shape)}")
    values = priority_values(tensor)
    return (np.array(id_array, dtype=np.int64).reshape(-1),
            np.array(values, dtype=np.float64).reshape(-1))
