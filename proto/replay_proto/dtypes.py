"""The tensor dtypes a table column may have, by their stable names.

Names (not ``torch.dtype`` objects, not pickles) are what schemas, checkpoints
and the wire carry, so they must never change meaning.
"""

from __future__ import annotations

import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}

_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of ``dtype``.

    Raises:
        ValueError: ``dtype`` cannot be stored in a table (complex, quantized, ...).
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported; supported dtypes: {', '.join(DTYPES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype called ``name`` (as returned by :func:`dtype_name`).

    Raises:
        ValueError: no supported dtype has that name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype name {name!r}; supported dtypes: {', '.join(DTYPES)}"
        ) from None


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory (a CPU tensor); numpy has no bfloat16, so a
    bfloat16 tensor is viewed as the same bits in int16 (copies and the wire need only the
    bytes)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()
