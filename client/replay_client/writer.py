"""``Writer``: the actor's per-step interface, batched and sent in the background.

An actor appends one step at a time; the writer stacks steps into columns and
a background thread inserts them ``batch_rows`` at a time (or whatever has
waited ``max_delay_s``), so the actor's loop never waits on the network unless
``max_pending_rows`` are already in flight (then ``append`` blocks: bounded
memory, backpressure).

Episodes: each step gets the writer's current episode id in ``episode_key``
(a random 62-bit id, fresh after every :meth:`Writer.end_episode`), which is
what slice tables need to keep an actor's steps together; ``episode_key=None``
adds no column (``ReplayClient.writer`` picks one or ``None`` from the table:
:attr:`~replay_client.table_info.TableInfo.writer_episode_key`). Episode ends
as data (``done``/``truncated``) are the step's own columns.

Errors: a step whose keys, dtypes or shapes differ from the first step's is
refused at ``append``. A failed background insert is raised, as
:class:`~replay_client.errors.WriterError` with the cause attached, by the next
``append``, ``flush`` or ``close``, saying how many rows were not stored;
nothing is dropped silently.

Columns: each step is copied straight into the current batch's preallocated
columns, one copy per key (a byte copy for a contiguous CPU tensor of the
key's dtype and shape, an assignment for a number), with no per-step dict or
tensor made; the episode id column is filled by slice when an episode or a
batch ends. A step that is not a flat dict of such values (nested, numpy,
TensorDict, non-contiguous, ...) takes a slower path that converts it first;
both store the same bytes.

Memory: the columns of a batch are reused once its insert has returned (at
most :data:`SPARE_BATCHES` batches are kept for that), so a long-running
actor does not allocate, and fault in, ``batch_rows`` rows of fresh memory
for every batch (7 MB per 256 Atari steps).

Thread-safety: use a writer from one thread (one writer per actor).
"""

from __future__ import annotations

import ctypes
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, cast

import torch

from replay_client.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ReplayError,
    WriterError,
)
from replay_proto.dtypes import dtype_name, numpy_view
from replay_proto.keys import flatten
from replay_proto.scalars import is_int, is_real

_STOP = object()

SPARE_BATCHES = 2
"""Sent batches whose columns a writer keeps for the next ones."""


class Inserter(Protocol):
    """What a writer sends its rows through (a ``ReplayClient``)."""

    def insert(self, table: str, data: Any) -> Any:
        """Insert ``data`` (columns with a leading dim of rows) into ``table``; raise on failure.

        It must be done with ``data`` when it returns (the writer reuses the memory).
        """


class Writer:
    """Appends steps to one table of a replay server.

    Args:
        client: what inserts the rows (a ``ReplayClient``; see :class:`Inserter`).
        table: table name.
        batch_rows: steps per insert.
        max_pending_rows: steps buffered or in flight before ``append`` blocks.
        max_delay_s: longest a step waits before it is sent anyway.
        episode_key: column receiving the episode id (``None``: add none).
    """

    def __init__(
        self,
        client: Inserter,
        table: str,
        *,
        batch_rows: int = 256,
        max_pending_rows: int = 8192,
        max_delay_s: float = 0.2,
        episode_key: str | None = "episode",
    ) -> None:
        if not is_int(batch_rows) or batch_rows < 1:
            raise InvalidArgumentError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
        if not is_int(max_pending_rows) or max_pending_rows < batch_rows:
            raise InvalidArgumentError(
                f"max_pending_rows must be an integer >= batch_rows ({batch_rows}), "
                f"got {max_pending_rows!r}"
            )
        if not is_real(max_delay_s) or not 0 < max_delay_s < float("inf"):
            raise InvalidArgumentError(f"max_delay_s must be a number of seconds > 0, got "
                                       f"{max_delay_s!r}")
        if episode_key is not None and (not isinstance(episode_key, str) or not episode_key):
            raise InvalidArgumentError(f"episode_key must be a column name or None, got "
                                       f"{episode_key!r}")
        self.table = table
        self._client = client
        self._batch_rows = batch_rows
        self._max_pending = max_pending_rows
        self._max_delay = max_delay_s
        self._episode_key = episode_key
        self._episode = secrets.randbits(62)
        # Fixed by the first step: each key's (dtype, per-step shape), the user's keys only.
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Steps are copied into preallocated columns of batch_rows rows as they arrive.
        self._columns: dict[str, torch.Tensor] = {}
        self._rows: dict[str, Any] = {}  # numpy views of _columns
        # Per user key, where append copies a step's value: see _Slot. None until the
        # first step fixed the layout.
        self._slots: dict[str, _Slot] | None = None
        self._filled = 0
        self._episode_from = 0  # first row of the current batch in the current episode
        self._oldest = 0.0
        # (the batch's full columns, its filled rows) per handed-over batch, or _STOP
        self._chunks: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | object] = []
        self._spare: list[dict[str, torch.Tensor]] = []  # sent batches' columns, to reuse
        self._in_flight = 0     # rows handed over but not yet acknowledged (or failed)
        self._error: BaseException | None = None
        self._lost = 0          # rows not stored because of the error
        self._closed = False
        self.rows_written = 0   # rows the server acknowledged
        self._thread = threading.Thread(target=self._send_loop, name=f"writer-{table}",
                                        daemon=True)
        self._thread.start()

    @property
    def episode_id(self) -> int:
        """The id the next appended step gets."""
        return self._episode

    # ------------------------------------------------------------- caller side

    def append(self, step: Any, episode: int | None = None) -> None:
        """Add one step (a mapping, possibly nested, or TensorDict; no row dim).

        ``episode``: the step's episode id instead of the writer's current one (a
        :class:`~replay_client.vector_writer.VectorWriter` keeps one per sub-env).

        The step's values are copied, so the caller may reuse its buffers.
        Blocks while ``max_pending_rows`` steps are buffered or in flight.

        Raises:
            InvalidArgumentError: the step's keys, dtypes or shapes differ from
                the first step's, or a value is not a tensor/array/number.
            WriterError: an earlier background insert failed.
        """
        if self._slots is not None and type(step) is dict and len(step) == len(self._slots):
            with self._lock:
                if (self._filled + self._in_flight >= self._max_pending or self._error is not None
                        or self._closed):
                    self._wait_for_room()
                # (read under the lock: a batch handed over meanwhile has new columns)
                if _copy_row(step, self._slots, self._filled):
                    if episode is not None:
                        self._stamp_episode(episode)
                    self._commit_row()
                    return
        values = self._convert(step)  # the first step, or one the fast path did not take
        with self._lock:
            self._wait_for_room()
            row = self._filled
            for key, value in values.items():
                self._rows[key][row] = value
            if episode is not None:
                self._stamp_episode(episode)
            self._commit_row()

    def end_episode(self) -> None:
        """Start a new episode: later steps get a new episode id."""
        with self._lock:
            self._fill_episode()
            self._episode = secrets.randbits(62)

    def flush(self, timeout: float | None = None) -> None:
        """Send everything appended so far and wait until the server stored it.

        Raises:
            WriterError: a background insert failed.
            DeadlineExceededError: not done within ``timeout`` seconds (a ``TimeoutError``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_open(allow_closed=True)
            if self._filled:
                self._hand_over()
            while self._in_flight and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceededError(
                        f"writer for table {self.table!r}: flush timed out with "
                        f"{self._in_flight} rows still in flight")
                self._cond.wait(remaining)
            self._raise_error()

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the background thread. Idempotent."""
        if self._closed:
            self._raise_error()
            return
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._chunks.append(_STOP)
                self._cond.notify_all()
            self._thread.join(timeout=10)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:  # don't hide the caller's exception behind a flush error
            try:
                self.close()
            except ReplayError:
                pass

    def _wait_for_room(self) -> None:
        """Block while ``max_pending_rows`` are buffered or in flight; raise if the writer
        failed or is closed (caller holds the lock)."""
        while self._filled + self._in_flight >= self._max_pending and not self._error:
            self._cond.wait()
        if self._error is not None or self._closed:
            self._check_open()

    def _commit_row(self) -> None:
        """Count the row just copied at ``_filled``; hand the batch over when full (caller
        holds the lock)."""
        row = self._filled
        self._filled = row + 1
        if row == 0:
            self._oldest = time.monotonic()
            self._cond.notify_all()  # the sender now has a delay deadline to keep
        if row + 1 >= self._batch_rows:
            self._hand_over()

    def _stamp_episode(self, episode: int) -> None:
        """Give the row at ``_filled`` its own episode id (a vector writer's sub-env; caller
        holds the lock): the rows before it get the writer's id first."""
        if self._episode_key is not None:
            self._fill_episode()
            self._rows[self._episode_key][self._filled] = episode
            self._episode_from = self._filled + 1

    def _fill_episode(self) -> None:
        """Write the current episode id into the rows of this batch appended since the episode
        (or the batch) began: one slice per episode, not a write per step (caller holds the
        lock)."""
        if self._episode_key is not None and self._filled > self._episode_from:
            self._rows[self._episode_key][self._episode_from:self._filled] = self._episode
        self._episode_from = self._filled

    def _convert(self, step: Any) -> dict[str, Any]:
        """The slow path: flatten, convert and check a step (the first one fixes the layout)."""
        try:
            flat = flatten(step)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"writer for table {self.table!r}: {exc}") from None
        row = {}
        for key, value in flat.items():
            try:
                # (resolve_neg: a float tensor may be a negated view, e.g. a complex conj's .imag)
                tensor = (value.detach().cpu().resolve_neg() if isinstance(value, torch.Tensor)
                          else torch.as_tensor(value))
                dtype_name(tensor.dtype)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidArgumentError(
                    f"writer for table {self.table!r}: key {key!r}: {exc}"
                ) from None
            row[key] = tensor
        layout = {key: (t.dtype, tuple(t.shape)) for key, t in row.items()}
        if self._layout is None:
            with self._cond:
                self._layout = layout
                self._allocate()
        elif layout != self._layout:
            raise InvalidArgumentError(
                f"writer for table {self.table!r}: step differs from the first step: "
                f"{_describe_difference(self._layout, layout)}"
            )
        return {key: numpy_view(t) for key, t in row.items()}

    def _allocate(self) -> None:
        """Fresh columns for the next batch_rows steps (caller holds the lock)."""
        assert self._layout is not None
        layout = dict(self._layout)
        if self._episode_key is not None and self._episode_key not in layout:
            layout[self._episode_key] = (torch.int64, ())
        self._columns = self._spare.pop() if self._spare else {
            key: torch.empty((self._batch_rows, *shape), dtype=dtype)
            for key, (dtype, shape) in layout.items()
        }
        self._rows = {key: numpy_view(column) for key, column in self._columns.items()}
        self._slots = {key: _slot(dtype, shape, self._columns[key], self._rows[key])
                       for key, (dtype, shape) in self._layout.items()}

    def _hand_over(self) -> None:
        """Give the filled rows to the sender (caller holds the lock)."""
        self._fill_episode()
        self._episode_from = 0
        chunk = {key: column[: self._filled] for key, column in self._columns.items()}
        self._in_flight += self._filled
        self._chunks.append((self._columns, chunk))
        self._filled = 0
        self._allocate()
        self._cond.notify_all()

    def _check_open(self, allow_closed: bool = False) -> None:
        self._raise_error()
        if self._closed and not allow_closed:
            raise WriterError(f"writer for table {self.table!r} is closed")

    def _raise_error(self) -> None:
        if self._error is not None:
            raise WriterError(
                f"writer for table {self.table!r}: a background insert failed; {self._lost} rows "
                f"were not stored ({type(self._error).__name__}: {self._error})"
            ) from self._error

    # ------------------------------------------------------------- sender side

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._chunks:
                    waited = time.monotonic() - self._oldest
                    if self._filled and waited >= self._max_delay:
                        self._hand_over()
                        break
                    self._cond.wait(self._max_delay - waited if self._filled else None)
                chunk = self._chunks.pop(0)
            if chunk is _STOP:
                return
            assert isinstance(chunk, tuple)
            columns, chunk = chunk
            rows = next(iter(chunk.values())).shape[0]
            error: BaseException | None = None
            if self._error is None:
                try:
                    self._client.insert(self.table, chunk)
                except BaseException as exc:  # surfaced to the caller, never swallowed
                    error = exc
            with self._cond:
                self._in_flight -= rows
                if error is not None or self._error is not None:
                    self._error = self._error or error
                    self._lost += rows
                else:
                    self.rows_written += rows
                if len(self._spare) < SPARE_BATCHES:
                    self._spare.append(columns)  # insert returned: nothing reads them now
                self._cond.notify_all()


_SCALAR_DTYPES = {float: torch.get_default_dtype(), int: torch.int64, bool: torch.bool}

# C's memmove two ways. Holding the GIL, for a row of up to _RELEASE_FROM elements:
# ctypes.memmove releases and retakes the GIL on every call, which for a small row hands
# it to the sending thread once per step (measured: small-row writer throughput down
# 10-40% end to end). Releasing it, for larger rows, as numpy's copy does past 500
# elements: the sending thread encodes and sends on the other core meanwhile (measured:
# Atari rows 15% slower end to end with the copy holding the GIL).
_memmove_holding_gil = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)(cast(int, ctypes.cast(ctypes.memmove, ctypes.c_void_p).value))
_memmove_releasing_gil = ctypes.memmove
_RELEASE_FROM = 500


class _Slot(NamedTuple):
    """Where one key of a step goes in the current batch, and what it must be to go there
    directly (fixed by the first step)."""

    dtype: torch.dtype
    shape: torch.Size            # per step
    nbytes: int                  # one row of the column
    as_item: bool                # a 0-d integer or bool: copied as a Python number
    rows: Any                    # the column's numpy view (bfloat16 as int16 bits)
    address: int                 # the column's first byte
    copy: Callable[[int, int, int], Any]  # memmove(to, from, nbytes)


def _slot(dtype: torch.dtype, shape: tuple[int, ...], column: torch.Tensor, rows: Any) -> _Slot:
    row = column[0]
    return _Slot(dtype, torch.Size(shape), row.nbytes,
                 not shape and not dtype.is_floating_point and dtype != torch.bfloat16,
                 rows, column.data_ptr(),
                 _memmove_releasing_gil if row.numel() > _RELEASE_FROM else _memmove_holding_gil)


def _copy_row(step: dict[str, Any], slots: dict[str, _Slot], row: int) -> bool:
    """Copy ``step`` into row ``row`` of the columns, one copy per key; ``False`` (with the
    row partly written, not yet counted) when a key or value is not of the fixed layout or
    not a plain CPU tensor or number, for the slow path to convert or refuse.

    A contiguous CPU tensor of the key's dtype and shape is copied byte for byte
    (``memmove``: exact for every dtype, bfloat16 and NaN payloads included, and about
    half the cost of ``tensor.numpy()`` and a numpy assignment); a 0-d integer or bool
    tensor as its ``item()``, which is exact and cheaper still.
    """
    try:
        for key, value in step.items():
            slot = slots.get(key)
            if slot is None:
                return False
            if type(value) is torch.Tensor:
                if (value.dtype is not slot.dtype or value.shape != slot.shape
                        or not value.is_cpu or not value.is_contiguous() or value.is_neg()):
                    return False
                if slot.as_item:
                    slot.rows[row] = value.item()
                else:
                    slot.copy(slot.address + row * slot.nbytes, value.data_ptr(), slot.nbytes)
            elif _SCALAR_DTYPES.get(type(value)) is slot.dtype and not slot.shape:
                slot.rows[row] = value
            else:
                return False
    except (RuntimeError, TypeError, ValueError, OverflowError):
        return False  # e.g. a sparse tensor, an int beyond int64: the slow path says what
    return True


def _describe_difference(
    first: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    now: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> str:
    missing = [k for k in first if k not in now]
    extra = [k for k in now if k not in first]
    if missing or extra:
        return f"missing keys {missing}, unexpected keys {extra}"
    for key, (dtype, shape) in first.items():
        if now[key] != (dtype, shape):
            return (f"key {key!r} was {str(dtype).removeprefix('torch.')}{list(shape)}, now "
                    f"{str(now[key][0]).removeprefix('torch.')}{list(now[key][1])}")
    return "layout differs"
