"""Nested keys as flat keys.

A row may be a nested mapping (or a TensorDict), like
``{"obs": {"pixels": ..., "state": ...}, "action": ...}``. Tables, checkpoints
and the wire store one column per leaf under a flat key that joins the path
with :data:`KEY_SEPARATOR`: ``"obs.pixels"``, ``"obs.state"``, ``"action"``.
This is the same convention as ``TensorDict.flatten_keys(".")``. A key that
contains the separator is read as a path, so ``{"obs.pixels": x}`` and
``{"obs": {"pixels": x}}`` are the same row; a path may not be given twice,
nor be both a leaf and a prefix of another path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

KEY_SEPARATOR = "."


def is_tensordict(obj: object) -> bool:
    """Whether ``obj`` is a TensorDict (duck typed, so tensordict stays optional here)."""
    return hasattr(obj, "flatten_keys") and hasattr(obj, "batch_size")


def flatten(data: Any) -> dict[str, Any]:
    """Flatten a nested mapping or TensorDict into ``{flat_key: leaf}``.

    Args:
        data: a mapping whose values are leaves (tensors, arrays, ...) or nested
            mappings, or a ``tensordict.TensorDict``.

    Returns:
        A new dict in the data's own key order (depth first).

    Raises:
        TypeError: ``data`` is not a mapping, or a key is not a string.
        ValueError: a key is empty or contains the separator, or a nested
            mapping is empty.
    """
    if is_tensordict(data):
        data = data.to_dict()
    if not isinstance(data, Mapping):
        raise TypeError(
            f"expected a mapping of column name to tensor (or a TensorDict), "
            f"got {type(data).__name__}"
        )
    out: dict[str, Any] = {}
    _flatten_into(data, "", out)
    check_prefixes(out)
    return out


def check_prefixes(keys: Iterable[str]) -> None:
    """Raise unless no key equals another key's path prefix (``"a"`` and ``"a.b"``).

    Every prefix of every key is looked up, so keys that sort between the
    two (``"a-b"`` sorts between ``"a"`` and ``"a.b"``) hide nothing.
    Cost: O(total length of the keys).

    Raises:
        ValueError: naming both keys.
    """
    present = set(keys)
    for key in present:
        end = key.find(KEY_SEPARATOR)
        while end >= 0:
            if key[:end] in present:
                raise ValueError(f"key {key[:end]!r} is both a value and the parent of {key!r}")
            end = key.find(KEY_SEPARATOR, end + 1)


def _flatten_into(data: Mapping[Any, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"keys must be strings, got {key!r} ({type(key).__name__})")
        if not key or any(not part for part in key.split(KEY_SEPARATOR)):
            raise ValueError(
                f"invalid key {prefix + key!r}: keys and the parts of a dotted path must "
                f"be non-empty"
            )
        path = prefix + key
        if path in out:
            raise ValueError(f"key {path!r} is given twice (once as a dotted path)")
        if hasattr(value, "shape") and not is_tensordict(value):
            out[path] = value  # tensors and arrays: skip the (slow) Mapping ABC check
            continue
        if is_tensordict(value):
            value = value.to_dict()
        if isinstance(value, Mapping):
            if not value:
                raise ValueError(f"nested key {path!r} holds an empty mapping")
            _flatten_into(value, path + KEY_SEPARATOR, out)
        else:
            out[path] = value


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the nested dict that :func:`flatten` flattened.

    ``unflatten(flatten(d)) == d`` for every nested dict ``d`` of leaves.
    """
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(KEY_SEPARATOR)
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
