"""Which steps of a sampled slice are real: the one fact about partial slices both sides share.

A slice table whose slices may be cut short (its ``strict_length = false``,
or a span: ``TableCapabilities.partial_slices``, ``span_left``,
``span_right``) still returns ``[B, slice_len]`` ids: past a slice's last real
step its window repeats that step's id (and its row). Ids are never reused,
so a repeated id is padding, and a window's length is 1 plus the number of
times its id changes.

Thread-safety: pure functions.
"""

from __future__ import annotations

import torch


def real_steps(ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, slice_len]``: True at a window's real steps (a True prefix per row).

    Cost: O(B * slice_len), one comparison per step.
    """
    mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    if ids.shape[-1] > 1:
        mask[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return mask

