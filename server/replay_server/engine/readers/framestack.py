"""Frame-stack dedup: one frame per step for a stacked observation, stacks rebuilt at sample time.

An Atari-style row holds ``obs`` ``[stack, H, W]`` and ``next.obs``
``[stack, H, W]``: 2 * stack frames, of which ``stack - 1`` repeat the
previous step's and ``stack - 1`` repeat ``obs``. A table with
``frame_stack_key = "obs"`` stores, per row, only the newest frame of each
(``obs[-1]`` and ``next.obs[-1]``: 2 frames instead of 2 * stack; a table
without ``next.obs``, e.g. of sequences, 1) and links each row to the
previous step of its episode; a sample rebuilds::

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

It is a reader (:mod:`replay_server.engine.readers.base`): the frames are
read through the reader below it, so they may be stored compressed, in a
file or on a device, and the positions it is asked for may be rows or slices
(``[B, L]``: each step of each slice gets its stack; the frames a slice's
stacks share are read once). The n-step reader above it reads ``next.<key>``
of a transition's last step through it, without ``<key>``: its ``stack - 1``
frames and the next frame in one interleaved read.

Cost: insert O(rows * stack) link and frame compares; sample, per row:
``stack - 1`` link lookups, ``stack + 1`` frames read (the stack and the next
frame) and ``stack - 1`` copied (``next.<key>``'s shared frames), instead of
``2 * stack`` frames read; per step of a slice, one frame read and ``stack``
copied. Memory: 16 bytes per slot of links. Not thread-safe: called under the
table's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replay_proto.dtypes import numpy_view
from replay_server.engine import buffers
from replay_server.engine.ids import IdRing
from replay_server.engine.insert_event import InsertEvent
from replay_server.engine.reader_options import next_key, storage_schema
from replay_server.engine.readers.base import Reader
from replay_server.engine.schema import FieldSpec, Schema
from replay_server.engine.slot_memory import FRAMESTACK_SLOT_BYTES
from replay_server.engine.snapshot import saved_copy
from replay_server.engine.workers import take_rows
from replay_server.errors import InvalidArgumentError, SchemaMismatchError

_MIN_SWEEP = 1024
"""Open episodes kept before those whose newest step left the ring are forgotten."""


def check_stack_columns(table: str, key: str, schema: Mapping[str, FieldSpec]) -> None:
    """The stacked key must exist with a shape ``[stack >= 2, ...]``, and ``next.<key>``, if
    present, with the same spec.

    Raises:
        SchemaMismatchError: naming what is missing or wrong.
    """
    spec, following = schema.get(key), schema.get(next_key(key))
    if spec is None:
        raise SchemaMismatchError(
            f"table {table!r}: frame_stack_key={key!r} needs key {key!r} (the stacked "
            f"observation, with {next_key(key)!r} the next one if the rows have it); the "
            f"schema has {sorted(schema)}")
    if len(spec.shape) < 2 or spec.shape[0] < 2 or (following is not None and spec != following):
        raise SchemaMismatchError(
            f"table {table!r}: frame_stack_key={key!r} needs {key!r}"
            f"{'' if following is None else f' and {next_key(key)!r}'} of one shape "
            f"[stack >= 2, ...] and dtype; got {spec.describe()}"
            f"{'' if following is None else f' and {following.describe()}'}")


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


class FrameStacks(Reader):
    """Links, kept histories and the stack rebuild of one table (see the module docstring).

    Args:
        ring: the table's id ring (positions).
        source: the reader below (the stored frames).
        key: the stacked key (``next.<key>`` is stacked too when the schema has it).
        schema: the table's schema (as inserted).
        fill: ``"repeat"`` or ``"zero"``: the frames before an episode's first step.
    """

    STATE_KEY = "frames"
    SLOT_BYTES = FRAMESTACK_SLOT_BYTES
    """Per slot: the previous and the next step's positions (int64 each)."""

    def __init__(self, ring: IdRing, source: Reader, key: str, schema: Schema,
                 fill: str) -> None:
        super().__init__(ring, source)
        self.key = key
        self.next_key = next_key(key) if next_key(key) in schema else None
        self.stack = schema[key].shape[0]
        self.fill = fill
        self._spec = schema[key]
        self._prev = np.full(ring.capacity, -1, dtype=np.int64)
        self._next = np.full(ring.capacity, -1, dtype=np.int64)
        self._open: dict[int, int] = {}
        self._kept: dict[int, np.ndarray] = {}  # position -> its stack - 1 older frames
        self._sweep_at = _MIN_SWEEP

    @property
    def _stacked(self) -> tuple[str, ...]:
        return (self.key,) if self.next_key is None else (self.key, self.next_key)

    def stored_schema(self, schema: Schema) -> Schema:
        return storage_schema(schema, self.key)

    def stored(self, columns: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The columns as stored: the stacked keys reduced to their newest frame."""
        stored = dict(columns)
        for name in self._stacked:
            stored[name] = columns[name][:, -1]
        return stored

    def check(self, columns: Mapping[str, torch.Tensor], table: str) -> None:
        check_insert(columns, self.key, table)

    # ------------------------------------------------------------------ insert

    def before_write(self, event: InsertEvent) -> None:
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
                stacks = _numpy(self._rebuild(rows, gone_below=int(gone[0])))
                for position, frames in zip(rows.tolist(), stacks):
                    self._kept[position] = frames[:-1].copy()
        if self._kept:  # after the rebuild, which may read them
            for position in gone.tolist():
                self._kept.pop(position, None)

    def after_write(self, event: InsertEvent, columns: Mapping[str, torch.Tensor]) -> None:
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
        rebuilt = _numpy(self._rebuild(positions))
        given = _numpy(columns[self.key].detach().cpu())
        differs = (rebuilt != given).reshape(positions.size, -1).any(axis=1)
        for index in np.flatnonzero(differs).tolist():
            self._kept[int(positions[index])] = given[index, :-1].copy()

    # ------------------------------------------------------------------ sample

    def read(self, positions: np.ndarray | None, keys: list[str] | None = None,
             out: Mapping[str, torch.Tensor] | None = None,
             slots: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The rows at ``positions`` (any shape ``S``, live) with their stacks rebuilt.

        The stacks are built in place in the destination tensors (``out``'s
        where given): the frames of every row's stack are read in one read
        through the source into ``<key>``; ``next.<key>`` is those rows'
        frames ``1..stack - 1`` (one strided copy) and the next frame, read
        straight into place. Without ``<key>`` (an n-step transition's last
        step), ``next.<key>`` is read alone: its ``stack - 1`` frames and the
        next frame in one interleaved read through the source.
        """
        if positions is None:  # the links are by position
            assert slots is not None
            positions = self._ring.ids_of_slots(slots)
        wanted = self.keys if keys is None else keys
        others = [k for k in wanted if k not in self._stacked]
        assert self.source is not None
        columns = self.source.read(positions, others, out, slots) if others else {}
        want_stack = self.key in wanted
        want_next = self.next_key is not None and self.next_key in wanted
        if not want_stack and not want_next:
            return columns
        shape, frame = (*positions.shape, *self._spec.shape), self._spec.shape
        flat = positions.reshape(-1)
        walk = self._walk(flat)
        if not want_stack:
            assert self.next_key is not None
            following = self._destination(self.next_key, out, shape, True, columns).view(-1, *frame)
            parts = [(self.key, walk.frames[:, j]) for j in range(1, self.stack)]
            self.source.read_regions([([*parts, (self.next_key, flat)], following)])
            walk.place(following, shift=1)
            return columns
        stacks = self._destination(self.key, out, shape, True, columns).view(-1, *frame)
        self._read_frames(walk.frames, stacks, steps=positions.shape[-1] if positions.ndim > 1
                          else 1)
        walk.place(stacks)
        if want_next:
            assert self.next_key is not None
            following = self._destination(self.next_key, out, shape, True, columns).view(-1, *frame)
            _shift(stacks, following)
            self.source.read(flat, [self.next_key], {self.next_key: following[:, -1]},
                             None if slots is None else slots.reshape(-1))
        return columns

    def read_steps(self, positions: np.ndarray | None, slots: np.ndarray, keys: list[str],
                   last: np.ndarray, last_keys: list[str],
                   out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """An n-step transition's ``<key>`` at its first step and ``next.<key>`` at its last
        (with the other columns asked for), the frames they share read once.

        The two stacks go straight into their destinations in one read through the
        source (:meth:`Reader.read_regions`): ``<key>``'s frames, then ``next.<key>``'s
        (``stack - 1`` frames of ``<key>`` and the next frame), which for a transition of
        ``m`` steps repeat ``stack - m`` of the first; a source that can (lz4) decodes
        each distinct stored frame of the batch once and copies it where it repeats.
        Otherwise (``<key>`` or ``next.<key>`` not asked for at those steps) as
        :meth:`Reader.read_steps`.
        """
        assert self.source is not None
        if (self.next_key is None or self.key not in keys or self.next_key not in last_keys
                or self.next_key in keys or self.key in last_keys):
            return super().read_steps(positions, slots, keys, last, last_keys, out)
        head = [k for k in keys if k != self.key]
        tail = [k for k in last_keys if k != self.next_key]
        columns = self.source.read_steps(positions, slots, head, last, tail, out)
        if positions is None:
            positions = self._ring.ids_of_slots(slots)
        shape, frame = (*positions.shape, *self._spec.shape), self._spec.shape
        first, ends = positions.reshape(-1), self._ring.ids_of_slots(last.reshape(-1))
        stacks = self._destination(self.key, out, shape, True, columns).view(-1, *frame)
        following = self._destination(self.next_key, out, shape, True, columns).view(-1, *frame)
        walk, end_walk = self._walk(first), self._walk(ends)
        self.source.read_regions([
            ([(self.key, walk.frames[:, j]) for j in range(self.stack)], stacks),
            ([*((self.key, end_walk.frames[:, j]) for j in range(1, self.stack)),
              (self.next_key, ends)], following)])
        walk.place(stacks)
        end_walk.place(following, shift=1)
        return columns

    def _destination(self, name: str, out: Mapping[str, torch.Tensor] | None,
                     shape: tuple[int, ...], wanted: bool,
                     columns: dict[str, torch.Tensor]) -> torch.Tensor:
        """``out[name]`` if given, else a new tensor on the batch's device; entered in
        ``columns`` when ``wanted``."""
        dest = None if out is None else out.get(name)
        if dest is None:
            dest = buffers.empty(shape, self._spec.dtype, self.device)
        if wanted:
            columns[name] = dest
        return dest

    def _rebuild(self, positions: np.ndarray, gone_below: int | None = None) -> torch.Tensor:
        """Stacks ``[n, stack, ...]`` of ``positions`` (see :meth:`_walk`), read into a new
        tensor."""
        walk = self._walk(positions, gone_below)
        into = buffers.empty((positions.size, *self._spec.shape), self._spec.dtype, self.device)
        self._read_frames(walk.frames, into)
        walk.place(into)
        return into

    def _walk(self, positions: np.ndarray, gone_below: int | None = None) -> _Walk:
        """Where the frames of the stacks of ``positions`` come from.

        Walks each row's links back to find the positions of its frames; a
        row on the way with a kept history supplies the older frames from it;
        an episode's start (or a link below the ring's oldest row) ends the
        walk and the rest is filled (``repeat``: the earliest frame again).
        ``gone_below``: rows from this position on are still readable although
        the ring's ``first_live`` has passed them (they are about to be overwritten).
        """
        cap = self._ring.capacity
        floor = self._ring.first_live if gone_below is None else gone_below
        n = positions.size
        frames = np.empty((n, self.stack), dtype=np.int64)
        frames[:, -1] = positions
        filled = np.zeros((n, self.stack), dtype=bool) if self.fill == "zero" else None
        current = positions.copy()
        walking = np.ones(n, dtype=bool)
        kept = np.sort(np.fromiter(self._kept, dtype=np.int64, count=len(self._kept)))
        overrides: list[tuple[int, int, np.ndarray]] = []
        for k in range(2, self.stack + 1):
            if kept.size:  # membership by a search in the (few) kept rows, sorted
                at = np.minimum(np.searchsorted(kept, current), kept.size - 1)
                hit = walking & (kept[at] == current)
                for index in np.flatnonzero(hit).tolist():
                    overrides.append((index, self.stack - k + 1, self._kept[int(current[index])]))
                walking &= ~hit
            previous = self._prev[current % cap]
            ok = walking & (previous >= floor)
            walking = ok
            current = np.where(ok, previous, current)
            frames[:, -k] = np.where(ok, current, frames[:, -k + 1])
            if filled is not None:
                filled[:, -k] = ~ok
        return _Walk(frames, filled, overrides, self._spec.dtype)

    def _read_frames(self, frames: np.ndarray, into: torch.Tensor, steps: int = 1) -> None:
        """``into[i, j] = frame at frames[i, j]``. ``steps > 1``: the rows are slices of
        ``steps`` consecutive steps each (in order), whose stacks share frames: each frame
        is read once (see :func:`_slice_reads`) and spread into place."""
        assert self.source is not None
        if steps < 2:
            self.source.read(frames, [self.key], {self.key: into})
            return
        reads, inverse = _slice_reads(frames, steps)
        once = self.source.read(reads, [self.key])[self.key]
        spread = into.view(-1, *self._spec.shape[1:])
        if once.device.type == "cpu":  # numpy's take, split across the worker pool
            take_rows(_numpy(once), inverse.reshape(-1), _numpy(spread))
        else:
            torch.index_select(once, 0, torch.from_numpy(inverse.reshape(-1)).to(once.device),
                               out=spread)

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


class _Walk:
    """The frames of some stacks: ``frames[i, j]``, the position whose stored frame is frame
    ``j`` of stack ``i``; ``filled[i, j]``: frame ``j`` is a zero fill (``zero`` only);
    ``overrides``: ``(i, count, history)``, the first ``count`` frames of stack ``i`` are
    the last ones of its kept ``history`` (exact: they win over fills)."""

    def __init__(self, frames: np.ndarray, filled: np.ndarray | None,
                 overrides: list[tuple[int, int, np.ndarray]], dtype: torch.dtype) -> None:
        self.frames, self.filled, self.overrides, self._dtype = frames, filled, overrides, dtype

    def place(self, into: torch.Tensor, shift: int = 0) -> None:
        """Apply the fills and kept histories to ``into`` ``[n, stack, ...]``, read from
        :attr:`frames`, or (``shift = 1``) to the next stacks read from ``frames[:, 1:]``
        and the next frames."""
        stack = self.frames.shape[1]
        if self.filled is not None and self.filled[:, shift:].any():
            mask = torch.from_numpy(np.ascontiguousarray(self.filled[:, shift:]))
            into[:, :stack - shift][mask.to(into.device)] = 0
        for index, count, history in self.overrides:
            if count > shift:
                into[index, :count - shift] = torch.from_numpy(
                    history[shift - count:]).view(self._dtype).to(into.device)


def _slice_reads(frames: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The frames to read for the stacks ``frames`` ``[n, stack]`` of slices of ``steps``
    consecutive steps (rows in slice order), and where each stack frame is among them:
    ``frames == reads[inverse]``.

    Frame ``k`` of step ``t``'s stack is, but at an episode's start or a kept history,
    the newest frame of step ``t - (stack - 1 - k)`` of the same slice: the reads are
    every step's newest frame, then the few others (a slice's first steps reach before
    it). O(n * stack) vector operations, no sort.
    """
    n, stack = frames.shape
    rows = np.arange(n)
    step = rows % steps
    newest = frames[:, -1]
    inverse = np.empty((n, stack), dtype=np.int64)
    inverse[:, -1] = rows
    other = np.zeros((n, stack - 1), dtype=bool)
    for k in range(stack - 1):
        back = stack - 1 - k
        source = np.where(step >= back, rows - back, rows)
        same = (step >= back) & (newest[source] == frames[:, k])
        inverse[:, k] = source
        other[:, k] = ~same
    extra = frames[:, :-1][other]
    inverse[:, :-1][other] = n + np.arange(extra.size)
    return np.concatenate((newest, extra)), inverse


def _shift(stacks: torch.Tensor, following: torch.Tensor) -> None:
    """``following[:, :-1] = stacks[:, 1:]``: through numpy on the host (a strided torch copy
    is several times slower there), torch's copy on a device."""
    if stacks.device.type == "cpu":
        np.copyto(_numpy(following)[:, :-1], _numpy(stacks)[:, 1:])
    else:
        following[:, :-1].copy_(stacks[:, 1:])


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return numpy_view(tensor.detach().cpu())
