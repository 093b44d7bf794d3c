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

Memory: the columns of a batch are reused once its insert has returned (at
most :data:`SPARE_BATCHES` batches are kept for that), so a long-running
actor does not allocate, and fault in, ``batch_rows`` rows of fresh memory
for every batch (7 MB per 256 Atari steps).

Thread-safety: use a writer from one thread (one writer per actor).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

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

        self._cond = threading.Condition(threading.Lock())
        # Steps are copied into preallocated columns of batch_rows rows as they arrive.
        self._columns: dict[str, torch.Tensor] = {}
        self._rows: dict[str, Any] = {}  # numpy views of _columns
        self._filled = 0
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
        values = step if self._fits(step) else self._convert(step)
        with self._cond:
            while self._filled + self._in_flight >= self._max_pending and not self._error:
                self._cond.wait()
            if self._error is not None or self._closed:
                self._check_open()
            row = self._filled
            for key, value in values.items():
                self._rows[key][row] = numpy_view(value) if type(value) is torch.Tensor else value
            if self._episode_key is not None:
                self._rows[self._episode_key][row] = self._episode if episode is None else episode
            self._filled = row + 1
            if row == 0:
                self._oldest = time.monotonic()
                self._cond.notify_all()  # the sender now has a delay deadline to keep
            if self._filled >= self._batch_rows:
                self._hand_over()

    def end_episode(self) -> None:
        """Start a new episode: later steps get a new episode id."""
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

    def _fits(self, step: Any) -> bool:
        """Fast check that ``step`` is a flat dict of CPU tensors/scalars of the fixed layout."""
        layout = self._layout
        if layout is None or type(step) is not dict or len(step) != len(layout):
            return False
        for key, value in step.items():
            spec = layout.get(key)
            if spec is None:
                return False
            kind = type(value)
            if kind is torch.Tensor:
                if (value.dtype != spec[0] or value.shape != spec[1] or value.requires_grad
                        or value.is_cuda):
                    return False
            elif _SCALAR_DTYPES.get(kind) != spec[0] or spec[1]:
                return False
        return True

    def _convert(self, step: Any) -> dict[str, Any]:
        """The slow path: flatten, convert and check a step (the first one fixes the layout)."""
        try:
            flat = flatten(step)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"writer for table {self.table!r}: {exc}") from None
        row = {}
        for key, value in flat.items():
            try:
                tensor = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
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

    def _hand_over(self) -> None:
        """Give the filled rows to the sender (caller holds the lock)."""
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
