"""Frame-stack dedup: one frame per step for a stacked observation, stacks rebuilt at sample time.

An Atari-style row holds ``obs`` ``[stack, H, W]`` and ``next.obs``
``[stack, H, W]``: 2 * stack frames, of which ``stack - 1`` repeat the
previous step's and ``stack - 1`` repeat ``obs``. A table with
``frame_stack_key = "obs"`` stores, per row, only the newest frame of each
(``obs[-1]`` and ``next.obs[-1]``: 2 frames instead of 2 * stack) and links
each row to the previous step of its episode; a sample rebuilds::

    obs      = [frame(t - stack + 1), ..., frame(t - 1), frame(t)]
    next.obs = [obs[1:], next_frame(t)]

following the links back (``t - 1`` is the previous *stored step of the same
episode*, however actors interleave). Before an episode's first step the
stack is filled as configured (``frame_stack_fill``): ``repeat`` the first
frame (Gym's ``FrameStackObservation`` with ``padding_type="reset"``,
Dopamine, DQN Zoo) or ``zero``.

**Bit-identical batches.** A batch is exactly what a table storing the full
stacks would return, whatever the inserts held: every insert is checked
(``next.obs[:-1]`` must equal ``obs[1:]``, or the insert is refused before
anything is stored), and a row whose ``obs`` is not what the links and the
fill rule rebuild (an actor whose environment pads otherwise, an episode
resumed after its earlier steps left the ring) keeps its ``stack - 1`` older
frames explicitly (*kept history*). So does a stored row whose older steps
are about to be overwritten by the ring: its stack is saved just before. A
row's kept history goes when the row goes. Kept histories are few (about
``stack - 1`` per episode crossing the ring's oldest row, plus mismatches);
they count in ``info`` (``sampler_stats["frame_history_rows"]``), not in the
memory ledger.

Cost: insert O(rows * stack) link and frame compares; sample, per row:
``stack - 1`` link lookups, ``stack + 1`` frames read (the stack and the next
frame) and ``stack - 1`` copied (``next.<key>``'s shared frames), instead of
``2 * stack`` frames read. Memory: 16 bytes per slot of links. Not thread-safe: called
under the table's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_server.engine.ids import IdRing
from replay_server.engine.samplers.base import InsertEvent
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.snapshot import saved_copy
from replay_server.engine import workers
from replay_server.engine.storage.memory import ColumnStorage
from replay_server.errors import InvalidArgumentError, SchemaMismatchError

FILLS = ("repeat", "zero")

_MIN_SWEEP = 1024
"""Open episodes kept before those whose newest step left the ring are forgotten."""

_PARALLEL_BYTES = 2 << 20
"""Rebuilds of at least this many bytes of stacks are split across the worker pool."""


def next_key(key: str) -> str:
    return f"next.{key}"


def check_stack_columns(table: str, key: str, schema: Mapping[str, FieldSpec]) -> None:
    """The stacked key and ``next.<key>`` must exist with one shape ``[stack >= 2, ...]``.

    Raises:
        SchemaMismatchError: naming what is missing or wrong.
    """
    spec, following = schema.get(key), schema.get(next_key(key))
    if spec is None or following is None:
        raise SchemaMismatchError(
            f"table {table!r}: frame_stack_key={key!r} needs keys {key!r} and "
            f"{next_key(key)!r} (the stacked observation and the next one); the schema has "
            f"{sorted(schema)}")
    if len(spec.shape) < 2 or spec.shape[0] < 2 or spec != following:
        raise SchemaMismatchError(
            f"table {table!r}: frame_stack_key={key!r} needs {key!r} and {next_key(key)!r} of "
            f"one shape [stack >= 2, ...] and dtype; got {spec.describe()} and "
            f"{following.describe()}")


def storage_schema(schema: Schema, key: str) -> Schema:
    """What is stored: the two stacked keys hold one frame per row."""
    fields = dict(schema.items())
    for name in (key, next_key(key)):
        fields[name] = FieldSpec(fields[name].dtype, fields[name].shape[1:])
    return Schema(fields)


def check_insert(columns: Mapping[str, torch.Tensor], key: str, table: str) -> None:
    """Refuse an insert whose ``next.<key>`` is not ``<key>`` shifted by one frame.

    Raises:
        InvalidArgumentError: naming the first such row.
    """
    obs, following = columns.get(key), columns.get(next_key(key))
    if obs is None or following is None or obs.shape != following.shape or obs.dim() < 3:
        return  # the schema check names what is wrong
    same = (following[:, :-1] == obs[:, 1:]).reshape(obs.shape[0], -1).all(dim=1)
    if not bool(same.all()):
        row = int((~same).nonzero()[0])
        raise InvalidArgumentError(
            f"table {table!r}: frame_stack_key={key!r}: row {row} has {next_key(key)}[:-1] != "
            f"{key}[1:]; a frame-stacked table needs each next observation to be the "
            f"observation shifted by one frame")


class FrameStacks:
    """Links, kept histories and the stack rebuild of one table (see the module docstring).

    Args:
        ring: the table's id ring (positions).
        key: the stacked key (``next.<key>`` is stacked too).
        stack: frames per stack.
        fill: ``"repeat"`` or ``"zero"``: the frames before an episode's first step.
    """

    SLOT_BYTES = 16
    """Per slot: the previous and the next step's positions (int64 each)."""

    def __init__(self, ring: IdRing, key: str, stack: int, fill: str) -> None:
        self._ring = ring
        self.key, self.next_key = key, next_key(key)
        self.stack = stack
        self.fill = fill
        self._prev = np.full(ring.capacity, -1, dtype=np.int64)
        self._next = np.full(ring.capacity, -1, dtype=np.int64)
        self._open: dict[int, int] = {}
        self._kept: dict[int, np.ndarray] = {}  # position -> its stack - 1 older frames
        self._sweep_at = _MIN_SWEEP
        self._others: list[str] | None = None  # the columns gathered as stored

    # ------------------------------------------------------------------ insert

    def before_write(self, storage: ColumnStorage, event: InsertEvent) -> None:
        """Keep the stacks of live rows whose older steps the insert will overwrite.

        Call after the ring advanced, before the storage is written.
        """
        if not event.evicted:
            return
        cap = self._ring.capacity
        gone = event.evicted_ids
        first_live = self._ring.first_live
        needy: list[np.ndarray] = []
        current = gone
        for _ in range(self.stack - 1):
            current = self._next[current % cap]
            current = current[current >= 0]
            if current.size == 0:
                break
            needy.append(current[current >= first_live])
        if needy:
            rows = np.unique(np.concatenate(needy))
            rows = np.array([p for p in rows.tolist() if p not in self._kept], dtype=np.int64)
            if rows.size:
                stacks = self._rebuild(storage.views[self.key], rows, gone_below=gone[0])
                for position, frames in zip(rows.tolist(), stacks):
                    self._kept[position] = frames[:-1].copy()
        if self._kept:  # after the rebuild, which may read them
            for position in gone.tolist():
                self._kept.pop(position, None)

    def frames_of(self, columns: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The columns as stored: the stacked keys reduced to their newest frame."""
        stored = dict(columns)
        for name in (self.key, self.next_key):
            stored[name] = columns[name][:, -1]
        return stored

    def after_write(self, storage: ColumnStorage, event: InsertEvent,
                    columns: Mapping[str, torch.Tensor]) -> None:
        """Link the new rows to their episodes; keep the history of rows the links cannot rebuild."""
        assert event.episodes is not None and event.ends is not None
        cap = self._ring.capacity
        positions = event.ids
        self._prev[positions % cap] = -1
        self._next[positions % cap] = -1
        order = np.argsort(event.episodes, kind="stable")
        sorted_eps = event.episodes[order]
        cuts = np.flatnonzero(sorted_eps[1:] != sorted_eps[:-1]) + 1
        first_live = self._ring.first_live
        for group in np.split(order, cuts):
            episode = int(event.episodes[group[0]])
            mine, ends = positions[group], event.ends[group]
            previous = self._open.pop(episode, None)
            if previous is not None and previous >= first_live:
                self._prev[mine[0] % cap] = previous
                self._next[previous % cap] = mine[0]
            follows = ~ends[:-1]
            self._prev[mine[1:][follows] % cap] = mine[:-1][follows]
            self._next[mine[:-1][follows] % cap] = mine[1:][follows]
            if not ends[-1]:
                self._open[episode] = int(mine[-1])
        if len(self._open) > self._sweep_at:  # episodes whose newest step left the ring
            self._open = {e: p for e, p in self._open.items() if p >= first_live}
            self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))
        rebuilt = self._rebuild(storage.views[self.key], positions)
        given = _numpy(columns[self.key])
        differs = (rebuilt != given).reshape(positions.size, -1).any(axis=1)
        for index in np.flatnonzero(differs).tolist():
            self._kept[int(positions[index])] = given[index, :-1].copy()

    # ------------------------------------------------------------------ sample

    def gather(self, storage: ColumnStorage, positions: np.ndarray,
               out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The rows at ``positions`` (int64 ``[B]``, live) with their stacks rebuilt.

        The stacks are built in place in the destination tensors (``out``'s
        where given): one ``np.take`` reads each row's ``stack`` frames into
        ``<key>``; ``next.<key>`` is those rows' frames ``1..stack - 1`` (one
        strided copy) and the next frame, taken straight into place. Rows of
        ``_PARALLEL_BYTES`` or more of stacks are split across the worker pool
        as plain gathers are.
        """
        cap = self._ring.capacity
        views = storage.views
        if self._others is None:
            self._others = [key for key in views if key not in (self.key, self.next_key)]
        slots = positions % cap
        columns = storage.gather(slots, out, keys=self._others)
        frames, next_frames = views[self.key], views[self.next_key]
        shape = (positions.size, self.stack, *frames.shape[1:])
        dtype = storage.schema[self.key].dtype
        stacks, following = (_numpy(self._destination(name, out, shape, dtype, columns))
                             for name in (self.key, self.next_key))

        def part(a: int, b: int) -> None:
            self._rebuild(frames, positions[a:b], into=stacks[a:b])
            np.copyto(following[a:b, :-1], stacks[a:b, 1:])
            np.take(next_frames, slots[a:b], axis=0, out=following[a:b, -1], mode="clip")

        parts = min(workers.THREADS, positions.size, max(1, stacks.nbytes // _PARALLEL_BYTES))
        if parts < 2:
            part(0, positions.size)
        else:
            bounds = [positions.size * i // parts for i in range(parts + 1)]
            workers.run_split(lambda task: part(*task), list(zip(bounds[:-1], bounds[1:])),
                              parts)
        return columns

    @staticmethod
    def _destination(name: str, out: Mapping[str, torch.Tensor] | None,
                     shape: tuple[int, ...], dtype: torch.dtype,
                     columns: dict[str, torch.Tensor]) -> torch.Tensor:
        """``out[name]`` if given, else a new tensor; entered in ``columns``."""
        dest = None if out is None else out.get(name)
        if dest is None:
            dest = torch.empty(shape, dtype=dtype)
        columns[name] = dest
        return dest

    def _rebuild(self, frames: np.ndarray, positions: np.ndarray,
                 gone_below: int | None = None, into: np.ndarray | None = None) -> np.ndarray:
        """Stacks ``[n, stack, ...]`` of ``positions`` from the stored frames and kept histories.

        Walks each row's links back to find the slots of its frames; a row on
        the way with a kept history supplies the older frames from it; an
        episode's start (or a link below the ring's oldest row) ends the walk
        and the rest is filled (``repeat``: the earliest frame's slot again).
        Then one ``np.take`` reads every frame into place.
        ``gone_below``: rows from this position on are still readable although
        the ring's ``first_live`` has passed them (they are about to be overwritten).
        ``into``: a contiguous array to build them in (else a new one).
        """
        cap = self._ring.capacity
        floor = self._ring.first_live if gone_below is None else gone_below
        n = positions.size
        slots = np.empty((n, self.stack), dtype=np.int64)
        slots[:, -1] = positions % cap
        filled = np.zeros((n, self.stack), dtype=bool) if self.fill == "zero" else None
        current = positions.copy()
        walking = np.ones(n, dtype=bool)
        kept = np.fromiter(self._kept, dtype=np.int64, count=len(self._kept))
        overrides: list[tuple[int, int, np.ndarray]] = []
        for k in range(2, self.stack + 1):
            if kept.size:
                hit = walking & np.isin(current, kept)
                for index in np.flatnonzero(hit).tolist():
                    overrides.append((index, self.stack - k + 1, self._kept[int(current[index])]))
                walking &= ~hit
            previous = self._prev[current % cap]
            ok = walking & (previous >= floor)
            walking = ok
            current = np.where(ok, previous, current)
            slots[:, -k] = np.where(ok, current % cap, slots[:, -k + 1])
            if filled is not None:
                filled[:, -k] = ~ok
        out = np.empty((n, self.stack, *frames.shape[1:]), dtype=frames.dtype) if into is None \
            else into
        np.take(frames, slots, axis=0, out=out, mode="clip")
        if filled is not None and filled.any():
            out[filled] = 0
        for index, count, history in overrides:  # a kept history is exact: it wins over fills
            out[index, :count] = history[-count:]
        return out

    # ------------------------------------------------------------- the rest

    def clear(self) -> None:
        self._open.clear()
        self._kept.clear()

    def stats(self) -> dict[str, Any]:
        return {"frame_history_rows": len(self._kept)}

    def state_dict(self, used: int) -> dict[str, Any]:
        kept = sorted(self._kept)
        frames = (np.stack([self._kept[p] for p in kept]) if kept
                  else np.empty((0,), dtype=np.uint8))
        episodes = list(self._open)
        return {"prev": torch.from_numpy(saved_copy(self._prev[:used])),
                "next": torch.from_numpy(saved_copy(self._next[:used])),
                "open_episodes": torch.tensor(episodes, dtype=torch.int64),
                "open_last": torch.tensor([self._open[e] for e in episodes], dtype=torch.int64),
                "kept_positions": torch.tensor(kept, dtype=torch.int64),
                "kept_frames": torch.from_numpy(frames)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, array in (("prev", self._prev), ("next", self._next)):
            saved = state[name].numpy()
            array.fill(-1)
            array[: saved.size] = saved
        self._open = {int(e): int(p) for e, p in zip(state["open_episodes"], state["open_last"])}
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._open))
        frames = state["kept_frames"].numpy()
        self._kept = {int(p): frames[i].copy() for i, p in enumerate(state["kept_positions"])}


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()
