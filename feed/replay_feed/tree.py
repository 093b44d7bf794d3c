"""The tensors inside whatever a learner's ``transform`` returns, and how to put them back.

A feed pins and copies exactly what the transform returned, whatever its
structure: a :class:`~replay_proto.batch.SampleBatch`, a TensorDict (duck
typed, so tensordict stays optional), mappings, lists, tuples (named ones
too) or a bare tensor. Anything else is kept as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from replay_proto.batch import SampleBatch

Rebuild = Callable[[list[torch.Tensor]], Any]


def tree_leaves(value: Any) -> tuple[list[torch.Tensor], Rebuild]:
    """The tensors in ``value`` and a function rebuilding ``value`` around replacements."""
    if isinstance(value, torch.Tensor):
        return [value], lambda ts: ts[0]
    if isinstance(value, SampleBatch):
        return value.tensors(), value.with_tensors
    if hasattr(value, "batch_size") and hasattr(value, "keys") and hasattr(value, "set"):
        keys = list(value.keys(include_nested=True, leaves_only=True))
        leaves = [value.get(k) for k in keys]
        cls, batch_size = type(value), value.batch_size

        def rebuild_td(ts: list[torch.Tensor]) -> Any:
            devices = {t.device for t in ts}
            out = cls({}, batch_size=batch_size, device=devices.pop() if len(devices) == 1 else None)
            for key, tensor in zip(keys, ts):
                out.set(key, tensor)
            return out

        return leaves, rebuild_td
    if isinstance(value, Mapping):
        parts = {k: tree_leaves(v) for k, v in value.items()}
        return _combine(list(parts.values()), lambda vs: dict(zip(parts, vs)))
    if isinstance(value, (list, tuple)):
        parts_seq = [tree_leaves(v) for v in value]
        kind = type(value)
        return _combine(parts_seq, lambda vs: kind(vs) if kind in (list, tuple) else kind(*vs))
    return [], lambda ts: value


def _combine(parts: list[tuple[list[torch.Tensor], Rebuild]],
             build: Callable[[list[Any]], Any]) -> tuple[list[torch.Tensor], Rebuild]:
    leaves: list[torch.Tensor] = []
    spans = []
    for sub, rebuild in parts:
        spans.append((len(leaves), len(leaves) + len(sub), rebuild))
        leaves.extend(sub)
    return leaves, lambda ts: build([rebuild(ts[a:b]) for a, b, rebuild in spans])
