"""Readers: how the rows a draw names become the columns of a batch.

A sampler names rows by position: ``[B]`` for a row sampler, ``[B, L]`` for
a slice sampler (each slice's steps in order). A table's readers turn those
positions into batch columns, stacked over one another, each reading
through the one below it (its ``source``):

* :class:`StoredRows` (always, at the bottom): the rows as stored, gathered
  from the table's storage, in the positions' shape;
* :class:`~replay_server.engine.readers.framestack.FrameStacks`
  (``frame_stack_key``): a stacked observation stored one frame per step,
  its stacks rebuilt from the frames below;
* :class:`~replay_server.engine.readers.nstep.NStepReturns` (``n_step > 1``):
  n-step transitions, reading the first step's columns and the last step's
  bootstrap columns through the readers below.

So n-step transitions over stacked frames, stacked frames inside slices,
and either over compressed or memory-mapped frames are the same code paths
as each alone. A reader may also shape what is stored (a frame stack keeps
one frame per step: :meth:`Reader.stored_schema`, :meth:`Reader.stored`)
and index inserts (episode links: :meth:`Reader.before_write`,
:meth:`Reader.after_write`). Each owns its state, its checkpoint part and
its memory per slot (``SLOT_BYTES``).

Readers never see samplers or the remover. Not thread-safe: called under
the table's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from replay_server.engine.ids import IdRing
from replay_server.engine.insert_event import InsertEvent
from replay_server.engine.schema import Schema

Region = tuple[Sequence[tuple[str, np.ndarray]], torch.Tensor]
"""``(parts, into)``: ``into[:, j]`` is column ``parts[j][0]`` of the rows at positions
``parts[j][1]`` (see :meth:`Reader.read_regions`)."""


class Reader(ABC):
    """One layer of a table's read path (see the module docstring).

    Args:
        ring: the table's id ring (positions to slots).
        source: the reader below (``None`` for :class:`StoredRows`).
    """

    SLOT_BYTES: ClassVar[int] = 0
    """Bytes of state per slot (promised when the table is made)."""

    STATE_KEY: ClassVar[str | None] = None
    """Its entry in a table's state (``None``: it saves nothing)."""

    def __init__(self, ring: IdRing, source: Reader | None) -> None:
        self._ring = ring
        self.source = source

    @property
    def keys(self) -> list[str]:
        """The batch columns it reads (before any it adds: :meth:`extra_layout`)."""
        assert self.source is not None
        return self.source.keys

    @property
    def device(self) -> torch.device:
        """Where its batches are (the storage's batch device)."""
        assert self.source is not None
        return self.source.device

    def stored_schema(self, schema: Schema) -> Schema:
        """What the storage must hold for batches of ``schema`` (as is, by default)."""
        return schema

    def stored(self, columns: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """An insert's columns as stored (as they are, by default)."""
        return columns

    def check(self, columns: Mapping[str, torch.Tensor], table: str) -> None:
        """Refuse an insert this reader could not serve exactly (before the lock)."""

    def before_write(self, event: InsertEvent) -> None:
        """The ring advanced; the storage is about to overwrite the evicted rows."""

    def after_write(self, event: InsertEvent, columns: Mapping[str, torch.Tensor]) -> None:
        """The rows of ``event`` were written (``columns``: as inserted)."""

    @abstractmethod
    def read(self, positions: np.ndarray | None, keys: list[str] | None = None,
             out: Mapping[str, torch.Tensor] | None = None,
             slots: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The batch columns ``keys`` (default: all of :attr:`keys` and the extras) of the
        rows at ``positions`` (int64, any shape ``S``, live rows): tensors ``[*S, ...]``,
        written into ``out``'s where given. ``slots``: the positions' slots, when the
        caller has them (a sampler does), passed on to reads at the same positions;
        with them ``positions`` may be ``None`` (a reader that needs the positions
        derives them: the stored rows need none)."""

    def read_regions(self, regions: Sequence[Region]) -> None:
        """For every region ``(parts, into)``: ``into[:, j]`` = column ``parts[j][0]`` of the
        rows at positions ``parts[j][1]`` (each ``[n]``, live rows; the columns share one
        spec): e.g. an observation's stack, and the next observation's, three frames of one
        column and the newest of another. Part by part here; the stored rows read them in
        one pass where their backend can, each distinct stored row once."""
        for parts, into in regions:
            for j, (key, positions) in enumerate(parts):
                self.read(positions, [key], {key: into[:, j]})

    def read_steps(self, positions: np.ndarray | None, slots: np.ndarray, keys: list[str],
                   last: np.ndarray, last_keys: list[str],
                   out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Columns ``keys`` of the rows at ``slots`` (their ``positions``, or ``None``) and
        ``last_keys`` of those at slots ``last`` (same shape): an n-step transition's
        first and last steps, into ``out``'s where given. Two reads here; a reader whose
        columns at the two share stored rows reads each of those once (a frame stack:
        ``<key>`` at ``t`` and ``next.<key>`` at ``t + m - 1`` share ``4 - m`` frames)."""
        columns = self.read(positions, keys, out, slots) if keys else {}
        if last_keys:
            columns.update(self.read(None, last_keys, out, last))
        return columns

    def extra_layout(self, lead: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Columns it adds to a batch with leading dims ``lead`` (none by default)."""
        return {} if self.source is None else self.source.extra_layout(lead)

    def clear(self) -> None:
        """Every row was removed (reset)."""

    def stats(self) -> dict[str, Any]:
        """Figures for ``info``."""
        return {}

    def state_dict(self, used: int) -> dict[str, Any] | None:
        """Its part of a checkpoint (tensors and plain values; ``None``: nothing to save)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ring and the rows are already restored)."""


class StoredRows(Reader):
    """The rows as the storage keeps them, gathered at the positions' slots."""

    def __init__(self, ring: IdRing) -> None:
        super().__init__(ring, None)
        self.storage: Any = None
        self._keys: list[str] = []

    def attach(self, storage: Any) -> None:
        """Read from ``storage`` (a :class:`~replay_server.engine.storage.columns.ColumnStorage`)."""
        self.storage = storage
        self._keys = list(storage.schema)

    @property
    def keys(self) -> list[str]:
        return self._keys

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.storage is None else self.storage.device

    def read(self, positions: np.ndarray | None, keys: list[str] | None = None,
             out: Mapping[str, torch.Tensor] | None = None,
             slots: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        if slots is None:
            assert positions is not None
            slots = self._ring.slots(positions)
        return self.storage.gather(slots, out, keys)

    def read_regions(self, regions: Sequence[Region]) -> None:
        ring = self._ring
        self.storage.gather_regions([([(key, ring.slots(positions)) for key, positions in parts],
                                      into) for parts, into in regions])
