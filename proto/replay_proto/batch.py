"""The container a sample comes back in, on the server and on the client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class SampleBatch:
    """One sampled batch and what the learner needs to use it.

    Attributes:
        data: the sampled rows as a nested dict of tensors (the structure that
            was inserted). Leading dims are ``[batch]`` for row samplers and
            ``[batch, slice_len]`` for slice samplers.
        ids: int64 row ids, shaped like the leading dims of ``data``. Pass them
            (or, for slices, ``ids[:, 0]``) to ``update_priorities``.
        weights: float32 ``[batch]`` importance weights,
            ``(N * P(i)) ** -beta / max_j w_j``; ones for non-prioritized samplers.
        probabilities: float64 ``[batch]`` probability with which each row (or
            slice start) was drawn.
    """

    data: dict[str, Any]
    ids: torch.Tensor
    weights: torch.Tensor
    probabilities: torch.Tensor

    @property
    def batch_size(self) -> int:
        """Number of rows (or slices) in the batch."""
        return int(self.ids.shape[0])

    def to_tensordict(self) -> Any:
        """``data`` as a ``tensordict.TensorDict`` with the batch's leading dims.

        Raises:
            ModuleNotFoundError: tensordict is not installed.
        """
        from tensordict import TensorDict

        return TensorDict(self.data, batch_size=self.ids.shape)
