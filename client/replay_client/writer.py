"""``Writer``: the actor's per-step interface, batched and sent in the background.

An actor appends one step at a time; the writer stacks steps into columns and
a background thread inserts them ``batch_rows`` at a time (or whatever has
waited ``max_delay_s``), so the actor's loop never waits on the network unless
``max_pending_rows`` are already in flight (then ``append`` blocks: bounded
memory, backpressure).

Episodes: each step gets the writer's current episode id in ``episode_key``
(a random 62-bit id, fresh after every :meth:`Writer.end_episode`), which is
what slice tables need to keep an actor's steps together. Episode ends as data
(``done``/``truncated``) are the step's own columns.

Errors: a step whose keys, dtypes or shapes differ from the first step's is
refused at ``append``. A failed background insert is raised, as
:class:`~replay_client.errors.WriterError` with the cause attached, by the next
``append``, ``flush`` or ``close``, saying how many rows were not stored;
nothing is dropped silently.

Thread-safety: use a writer from one thread (one writer per actor).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from replay_client.errors import InvalidArgumentError, ReplayError, WriterError
from replay_proto.dtypes import dtype_name
from replay_proto.keys import flatten

if TYPE_CHECKING:
    from replay_client.client import ReplayClient

_STOP = object()


class Writer:
    """Appends steps to one table of a replay server.

    Args:
        client: the server connection.
        table: table name.
        batch_rows: steps per insert.
        max_pending_rows: steps buffered or in flight before ``append`` blocks.
        max_delay_s: longest a step waits before it is sent anyway.
        episode_key: column receiving the episode id (``None``: add none).
    """

    def __init__(
        self,
        client: ReplayClient,
        table: str,
        *,
        batch_rows: int = 256,
        max_pending_rows: int = 8192,
        max_delay_s: float = 0.2,
        episode_key: str | None = "episode",
    ) -> None:
        if not isinstance(batch_rows, int) or batch_rows < 1:
            raise ValueError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
        if not isinstance(max_pending_rows, int) or max_pending_rows < batch_rows:
            raise ValueError(
                f"max_pending_rows must be an integer >= batch_rows ({batch_rows}), "
                f"got {max_pending_rows!r}"
            )
        if not max_delay_s > 0:
            raise ValueError(f"max_delay_s must be > 0, got {max_delay_s!r}")
        self.table = table
        self._client = client
        self._batch_rows = batch_rows
        self._max_pending = max_pending_rows
        self._max_delay = max_delay_s
        self._episode_key = episode_key
        self._episode = secrets.randbits(62)
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None

        self._cond = threading.Condition()
        self._pending: list[dict[str, torch.Tensor]] = []  # steps not yet handed to the sender
        self._oldest = 0.0
        self._chunks: list[list[dict[str, torch.Tensor]] | object] = []
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

    def append(self, step: Any) -> None:
        """Add one step (a mapping, possibly nested, or TensorDict; no row dim).

        Blocks while ``max_pending_rows`` steps are buffered or in flight.

        Raises:
            InvalidArgumentError: the step's keys, dtypes or shapes differ from
                the first step's, or a value is not a tensor/array/number.
            WriterError: an earlier background insert failed.
        """
        row = self._row(step)
        with self._cond:
            self._check_open()
            while len(self._pending) + self._in_flight >= self._max_pending and not self._error:
                self._cond.wait()
            self._check_open()
            if not self._pending:
                self._oldest = time.monotonic()
                self._cond.notify_all()  # the sender now has a delay deadline to keep
            self._pending.append(row)
            if len(self._pending) >= self._batch_rows:
                self._hand_over()

    def end_episode(self) -> None:
        """Start a new episode: later steps get a new episode id."""
        self._episode = secrets.randbits(62)

    def flush(self, timeout: float | None = None) -> None:
        """Send everything appended so far and wait until the server stored it.

        Raises:
            WriterError: a background insert failed.
            TimeoutError: not done within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_open(allow_closed=True)
            if self._pending:
                self._hand_over()
            while self._in_flight and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"writer flush: {self._in_flight} rows still in flight")
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

    def _row(self, step: Any) -> dict[str, torch.Tensor]:
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
        if self._episode_key is not None and self._episode_key not in row:
            row[self._episode_key] = torch.tensor(self._episode, dtype=torch.int64)
        layout = {key: (t.dtype, tuple(t.shape)) for key, t in row.items()}
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise InvalidArgumentError(
                f"writer for table {self.table!r}: step differs from the first step: "
                f"{_describe_difference(self._layout, layout)}"
            )
        return row

    def _hand_over(self) -> None:
        """Move pending steps to the sender (caller holds the lock)."""
        chunk, self._pending = self._pending, []
        self._in_flight += len(chunk)
        self._chunks.append(chunk)
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
                    if self._pending and waited >= self._max_delay:
                        self._hand_over()
                        break
                    self._cond.wait(self._max_delay - waited if self._pending else None)
                chunk = self._chunks.pop(0)
            if chunk is _STOP:
                return
            assert isinstance(chunk, list)
            error: BaseException | None = None
            if self._error is None:
                try:
                    columns = {key: torch.stack([row[key] for row in chunk]) for key in chunk[0]}
                    self._client.insert(self.table, columns)
                except BaseException as exc:  # surfaced to the caller, never swallowed
                    error = exc
            with self._cond:
                self._in_flight -= len(chunk)
                if error is not None or self._error is not None:
                    self._error = self._error or error
                    self._lost += len(chunk)
                else:
                    self.rows_written += len(chunk)
                self._cond.notify_all()


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
