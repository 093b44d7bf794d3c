"""A table's state (nested dicts of tensors and plain values) as JSON plus one binary blob.

:meth:`Table.snapshot <replay_server.engine.table.Table.snapshot>` gives nested
mappings whose leaves are torch tensors, numpy arrays, ints, floats, bools,
strings and ``None`` (lists and tuples of those too). :func:`encode_state`
turns that into a JSON tree, in which each array is replaced by a reference
``{"$tensor": {...}}`` or ``{"$ndarray": {...}}`` (dtype name, shape, offset
and length in the blob), plus the blob itself: the arrays' raw little-endian
bytes, concatenated, each aligned to 64 bytes. :func:`decode_state` reverses
it. Nothing is pickled and decoding runs no code, so whatever a table adds to
its state later (a rate limiter's counters, say) is saved and restored
without this module knowing about it.

Not thread-sensitive: pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.dtypes import dtype_from_name, dtype_name, numpy_dtype, numpy_view, tensor_view

_ALIGN = 64
_TENSOR, _NDARRAY = "$tensor", "$ndarray"


class StateFormatError(ValueError):
    """A state cannot be encoded, or an encoded state is malformed."""


def encode_state(state: Any) -> tuple[Any, list[np.ndarray]]:
    """``(tree, pieces)``: a JSON-able tree and the byte arrays of the blob, in order.

    The blob is ``b"".join(pieces)`` (the pieces include the alignment padding).

    Raises:
        StateFormatError: a value of another type, a non-string key, or a key
            starting with ``$``; the message names the path.
    """
    pieces: list[np.ndarray] = []
    offset = [0]

    def add(array: np.ndarray) -> dict[str, Any]:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        ref = {"offset": offset[0], "nbytes": int(data.size)}
        pieces.append(data)
        offset[0] += data.size
        pad = -offset[0] % _ALIGN
        if pad:
            pieces.append(np.zeros(pad, dtype=np.uint8))
            offset[0] += pad
        return ref

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu()
            name = dtype_name(tensor.dtype)
            return {_TENSOR: {"dtype": name, "shape": list(tensor.shape),
                              **add(numpy_view(tensor.contiguous()))}}
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "biuf":
                raise StateFormatError(f"{path}: cannot save a numpy array of dtype {value.dtype}")
            return {_NDARRAY: {"dtype": value.dtype.str, "shape": list(value.shape),
                               **add(value)}}
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str) or key.startswith("$"):
                    raise StateFormatError(
                        f"{path}: keys must be strings not starting with '$', got {key!r}")
                out[key] = walk(item, f"{path}.{key}")
            return out
        if isinstance(value, (list, tuple)):
            return [walk(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, np.generic):
            return walk(value.item(), path)
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        raise StateFormatError(f"{path}: cannot save a value of type {type(value).__name__}")

    return walk(state, "state"), pieces


def decode_state(tree: Any, blob: bytes | memoryview | np.ndarray) -> Any:
    """The state :func:`encode_state` encoded (arrays copied out of ``blob``).

    Raises:
        StateFormatError: the tree is malformed or points outside the blob.
    """
    data = np.frombuffer(blob, dtype=np.uint8)

    def array(ref: Any, path: str, dtype: np.dtype) -> np.ndarray:
        try:
            offset, nbytes = int(ref["offset"]), int(ref["nbytes"])
            shape = tuple(int(d) for d in ref["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFormatError(f"{path}: malformed array reference ({exc})") from None
        count = math.prod(shape)
        if offset < 0 or offset + nbytes > data.size or nbytes != count * dtype.itemsize:
            raise StateFormatError(
                f"{path}: array of {nbytes} bytes at offset {offset} does not fit shape "
                f"{list(shape)} of {dtype} in a blob of {data.size} bytes")
        return data[offset : offset + nbytes].view(dtype).reshape(shape).copy()

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                ref = value[_TENSOR]
                try:
                    dtype = dtype_from_name(ref["dtype"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise StateFormatError(f"{path}: bad tensor dtype ({exc})") from None
                return tensor_view(array(ref, path, numpy_dtype(dtype)), dtype)
            if set(value) == {_NDARRAY}:
                ref = value[_NDARRAY]
                try:
                    dtype = np.dtype(ref["dtype"])
                except (KeyError, TypeError) as exc:
                    raise StateFormatError(f"{path}: bad array dtype ({exc})") from None
                if dtype.kind not in "biuf":
                    raise StateFormatError(f"{path}: array dtype {dtype} is not allowed")
                return array(ref, path, dtype)
            if set(value) == {"$float"}:
                if value["$float"] not in ("inf", "-inf", "nan"):
                    raise StateFormatError(f"{path}: bad float {value['$float']!r}")
                return float(value["$float"])
            return {key: walk(item, f"{path}.{key}") for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return value

    return walk(tree, "state")
