"""The tensor dtypes a table column may have, by their stable names.

Names (not ``torch.dtype`` objects, not pickles) are what schemas, checkpoints
and the wire carry, so they must never change meaning.
"""

from __future__ import annotations

import numpy as np
import torch

from replay_proto.dtype_names import ITEMSIZES, check_dtype_name

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZES}
"""Every storable dtype by its name (:data:`~replay_proto.dtype_names.ITEMSIZES` declares the
names and their sizes, torch-free)."""

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
    return DTYPES[check_dtype_name(name)]


_BITS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
"""The numpy rule, written once: numpy has no bfloat16, so wherever a tensor meets numpy
(copies, the wire, storage arrays, checkpoints) a bfloat16 tensor is the same bits in int16
(copies and the wire need only the bytes), viewed back as bfloat16 on the way out."""


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose numpy arrays hold ``dtype``'s values bit for bit: ``dtype`` itself,
    or int16 for bfloat16 (which numpy lacks)."""
    return _BITS.get(dtype, dtype)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of :func:`numpy_view` arrays of ``dtype`` tensors (bfloat16: int16).
    Cached: O(1) after the first call per dtype."""
    found = _NUMPY.get(dtype)
    if found is None:
        found = _NUMPY[dtype] = torch.empty(0, dtype=bits_dtype(dtype)).numpy().dtype
    return found


_NUMPY: dict[torch.dtype, np.dtype] = {}


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory (a CPU tensor; bfloat16 as int16 bits)."""
    bits = _BITS.get(tensor.dtype)
    return (tensor if bits is None else tensor.view(bits)).numpy()


def tensor_view(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor sharing ``array``'s memory, the inverse of :func:`numpy_view`
    (``array`` of :func:`numpy_dtype`, bfloat16's int16 bits viewed back)."""
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if dtype in _BITS else tensor
