"""The container a sample comes back in, on the server and on the client.

Inside the system a batch is flat: one tensor per flat key (``"obs.pixels"``,
see :mod:`replay_proto.keys`), plus the three *extras* every sample carries.
Tables gather into flat columns, the wire encodes flat columns, the learner's
feed pins and copies flat tensors. Only a user looking at ``batch.data`` sees
the nested structure that was inserted; it is built on first access.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from replay_proto.keys import flatten, unflatten
from replay_proto.mass import SamplingMass

EXTRAS = ("ids", "weights", "probabilities")
"""The tensors every sample carries besides its columns, in wire order."""

STEPS_KEY = "steps_to_next_obs"
"""The column an n-step sample (``n_step > 1``) adds: each transition's number of steps
``m`` (TorchRL's name), of :data:`STEPS_DTYPE`."""

STEPS_DTYPE = torch.int64


def batch_nbytes(row_bytes: int, batch_size: int, slice_len: int | None = None,
                 n_step: int = 1) -> int:
    """Bytes of a sampled batch of ``batch_size`` rows (or slices of ``slice_len`` steps)
    whose stored row takes ``row_bytes``: per step the row, its int64 id (and an n-step
    transition's int64 step count); per row or slice a float32 weight and a float64
    probability. The one formula both sides size batches with (0 rows: ``row_bytes=0``
    gives the extras alone)."""
    steps = slice_len or 1
    extra = STEPS_DTYPE.itemsize if n_step > 1 else 0
    return batch_size * (steps * (row_bytes + 8 + extra) + 4 + 8)


@dataclass(frozen=True, init=False, eq=False)
class SampleBatch:
    """One sampled batch and what the learner needs to use it.

    Attributes:
        columns: the sampled rows by flat key (``"obs.pixels"``). Leading dims
            are ``[batch]`` for row samplers and ``[batch, slice_len]`` for
            slice samplers.
        ids: int64 row ids, shaped like the leading dims of the columns. Pass
            them (or, for slices, ``ids[:, 0]``) to ``update_priorities``.
        weights: float32 ``[batch]`` importance weights,
            ``(N * P(i)) ** -beta / max_j w_j``; ones for non-prioritized samplers.
        probabilities: float64 ``[batch]`` probability with which each row (or
            slice start) was drawn.
        mass: the table's :class:`~replay_proto.mass.SamplingMass` when the
            batch was drawn (``None`` where unknown: a batch built by hand or
            read from a shared-memory ring); a sharded client merges with it.
        missing_shards: shards a sharded client in degraded mode left out of
            this batch (unavailable): its probabilities and weights are over
            the other shards' rows only. Empty otherwise.

    Args:
        data: the rows as a nested mapping, a TensorDict or flat keys.
        ids, weights, probabilities: as above.
    """

    columns: dict[str, torch.Tensor]
    ids: torch.Tensor
    weights: torch.Tensor
    probabilities: torch.Tensor
    mass: SamplingMass | None = field(default=None, repr=False)
    missing_shards: tuple[int, ...] = field(default=(), repr=False)
    _nested: dict[str, Any] | None = field(default=None, repr=False)

    def __init__(self, data: Any, ids: torch.Tensor, weights: torch.Tensor,
                 probabilities: torch.Tensor) -> None:
        _set(self, flatten(data), ids, weights, probabilities)

    @classmethod
    def from_columns(cls, columns: Mapping[str, torch.Tensor], ids: torch.Tensor,
                     weights: torch.Tensor, probabilities: torch.Tensor,
                     mass: SamplingMass | None = None,
                     missing_shards: tuple[int, ...] = ()) -> SampleBatch:
        """A batch over already-flat ``columns`` (taken as they are: no copy, no checks)."""
        batch = cls.__new__(cls)
        _set(batch, dict(columns), ids, weights, probabilities, mass, missing_shards)
        return batch

    @classmethod
    def from_flat(cls, columns: Mapping[str, torch.Tensor], extras: Sequence[torch.Tensor],
                  mass: SamplingMass | None = None,
                  missing_shards: tuple[int, ...] = ()) -> SampleBatch:
        """:meth:`from_columns` with the extras (:data:`EXTRAS`: ids, weights,
        probabilities) as one sequence, in that order, as codecs carry them."""
        ids, weights, probabilities = extras
        return cls.from_columns(columns, ids, weights, probabilities, mass, missing_shards)

    @property
    def data(self) -> dict[str, Any]:
        """The rows as the nested dict of tensors that was inserted (built once, on first use)."""
        if self._nested is None:
            object.__setattr__(self, "_nested", unflatten(self.columns))
        assert self._nested is not None
        return self._nested

    @property
    def extras(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, weights, probabilities)``, in the order of :data:`EXTRAS`."""
        return self.ids, self.weights, self.probabilities

    @property
    def batch_size(self) -> int:
        """Number of rows (or slices) in the batch."""
        return int(self.ids.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch: the columns in key order, then the extras."""
        return [*self.columns.values(), *self.extras]

    def rows(self, start: int, stop: int) -> SampleBatch:
        """Rows ``start:stop`` of the batch, as views (the same mass)."""
        return SampleBatch.from_flat({k: v[start:stop] for k, v in self.columns.items()},
                                     [t[start:stop] for t in self.extras], mass=self.mass)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> SampleBatch:
        """The same batch over replacement ``tensors``, given in :meth:`tensors` order."""
        n = len(self.columns)
        if len(tensors) != n + len(EXTRAS):
            raise ValueError(f"expected {n + len(EXTRAS)} tensors, got {len(tensors)}")
        return SampleBatch.from_flat(dict(zip(self.columns, tensors[:n])), tensors[n:],
                                     mass=self.mass, missing_shards=self.missing_shards)

    def to_tensordict(self, weight_key: str = "_weight") -> Any:
        """The batch as a ``tensordict.TensorDict``, with TorchRL's names for the extras.

        The data keep their nested keys; ``"index"`` holds the ids and
        ``weight_key`` the importance weights: ``"_weight"`` by default (the
        design's name, TorchRL's before 0.10); current TorchRL releases and
        their losses read ``"priority_weight"``, which ``RemoteReplayBuffer``
        uses. The batch dimensions are the ids' shape: ``[batch]`` for row
        samplers, ``[batch, slice_len]`` for slice samplers, where each step
        carries its slice's weight. Tensors are shared, not copied (a view
        of a stream's staging buffer stays one). Usable as a stream's
        transform: ``client.stream(..., transform=SampleBatch.to_tensordict)``.

        Raises:
            ModuleNotFoundError: tensordict is not installed.
            ValueError: the data has a column named ``index`` or ``weight_key``.
        """
        from tensordict import TensorDict

        check_extras_names(self.columns, weight_key)
        lead = self.ids.shape
        weights = self.weights
        if len(lead) > 1:
            weights = weights.reshape(-1, *([1] * (len(lead) - 1))).expand(lead)
        td = TensorDict(self.data, batch_size=lead, device=self.ids.device)
        td.set("index", self.ids)
        td.set(weight_key, weights)
        return td

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}: {list(t.shape)}" for key, t in self.columns.items())
        return f"SampleBatch({self.batch_size} rows; {shapes})"


def check_extras_names(columns: Mapping[str, Any], weight_key: str) -> None:
    """Raise unless ``columns`` leave free the names a sample's TensorDict gives its extras
    (``"index"`` and ``weight_key``: :meth:`SampleBatch.to_tensordict`).

    Raises:
        ValueError: naming the column to rename.
    """
    for key, what in (("index", "ids"), (weight_key, "importance weights")):
        if key in columns:
            raise ValueError(f"the batch has a column named {key!r}, which to_tensordict "
                             f"uses for the {what}; rename that column")


def _set(batch: SampleBatch, columns: dict[str, torch.Tensor], ids: torch.Tensor,
         weights: torch.Tensor, probabilities: torch.Tensor,
         mass: SamplingMass | None = None, missing_shards: tuple[int, ...] = ()) -> None:
    for name, value in (("columns", columns), ("ids", ids), ("weights", weights),
                        ("probabilities", probabilities), ("mass", mass),
                        ("missing_shards", missing_shards), ("_nested", None)):
        object.__setattr__(batch, name, value)
