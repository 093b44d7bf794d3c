"""Reverb's rate limiter: when a table may take inserts and give samples.

A rate limiter keeps three counters, all in rows: ``inserts``, ``samples``
(rows returned by samples; a slice of ``slice_len`` steps counts
``slice_len``) and ``deletes`` (rows that left the table: overwritten by the
ring, or retired by ``max_times_sampled``), so ``inserts - deletes`` is the
table's size. Reset sets all three to 0. Two rules, exactly Reverb's
(``reverb/cc/rate_limiter.cc``), decide whether a call of ``n`` rows may go
ahead now::

    can_sample(n):  inserts - deletes >= min_size_to_sample
                    and inserts * spi - samples - n >= min_diff
    can_insert(n):  inserts + n - deletes <= min_size_to_sample      # filling up: free
                    or (inserts + n) * spi - samples <= max_diff

with ``spi = samples_per_insert`` and, as Reverb's ``SampleToInsertRatio``
does for a single ``error_buffer``::

    min_diff = spi * min_size_to_sample - error_buffer
    max_diff = spi * min_size_to_sample + error_buffer

So once the table holds ``min_size_to_sample`` rows, ``inserts * spi - samples``
stays within ``error_buffer`` of ``spi * min_size_to_sample``: samples wait when
the learner runs ahead of the actors, inserts wait when the actors run ahead.
Without ``samples_per_insert`` it is Reverb's ``MinSize``: samples wait for
``min_size_to_sample`` rows, inserts never wait (``min_diff = -inf``,
``max_diff = +inf``). A limiter with neither (``min_size_to_sample = 0``) lets
everything through but still counts, for ``info``.

Unlike Reverb, which admits one item at a time, a call here is admitted whole
or not at all, so a single call can be too large ever to pass: an insert of
``n`` rows moves the count by ``n * spi`` and a sample of ``n`` rows by ``n``,
and the window is ``max_diff - min_diff = 2 * error_buffer`` wide.
:meth:`RateLimiter.check_insert` and :meth:`RateLimiter.check_sample` refuse
such calls at once (naming the numbers) instead of letting them wait forever,
and raise :class:`~replay_server.errors.RateLimitedError` for calls that only
have to wait. Neither changes anything.

The limiter holds no reference to its table: the table calls it under its own
lock (check first, record after the change). Thread-safety: none of its own.
The ``can_*`` methods only read counters, so the service also calls them
without the lock, as a hint of whether a retry is worth it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from replay_server.config import TableConfig
from replay_server.errors import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    RateLimitedError,
)


@dataclass(frozen=True, slots=True)
class RateLimiterInfo:
    """A snapshot of a rate limiter, for ``info``.

    ``samples_per_insert`` and ``error_buffer`` are 0.0 when there is no ratio
    limit (then ``min_diff``/``max_diff`` are -inf/+inf); ``can_insert`` and
    ``can_sample`` are for a call of one row.
    """

    enabled: bool
    min_size_to_sample: int
    samples_per_insert: float
    error_buffer: float
    min_diff: float
    max_diff: float
    inserts: int
    samples: int
    deletes: int
    can_insert: bool
    can_sample: bool


class RateLimiter:
    """Counters plus Reverb's two admission rules (see the module docstring).

    Args:
        min_size_to_sample: rows the table must hold before anything is
            sampled (0: no minimum, and no limiter unless a ratio is set).
        samples_per_insert: the ratio to hold; ``None``: no ratio limit.
        error_buffer: half the width of the window the count may move in,
            required with ``samples_per_insert``.

    Cost: every method O(1).
    """

    def __init__(
        self,
        min_size_to_sample: int = 0,
        samples_per_insert: float | None = None,
        error_buffer: float | None = None,
    ) -> None:
        if (samples_per_insert is None) != (error_buffer is None):
            raise ConfigError("samples_per_insert and error_buffer go together")
        self.min_size_to_sample = min_size_to_sample
        self.samples_per_insert = samples_per_insert
        self.error_buffer = error_buffer
        if samples_per_insert is None or error_buffer is None:
            self._spi, self.min_diff, self.max_diff = 1.0, -math.inf, math.inf
        else:
            offset = samples_per_insert * min_size_to_sample
            self._spi = samples_per_insert
            self.min_diff, self.max_diff = offset - error_buffer, offset + error_buffer
        self.inserts = 0
        self.samples = 0
        self.deletes = 0

    @classmethod
    def from_config(cls, config: TableConfig) -> RateLimiter:
        """The limiter ``config`` describes (one that admits everything if it names none)."""
        return cls(
            config.effective_min_size_to_sample,
            config.samples_per_insert,
            config.effective_error_buffer,
        )

    @property
    def enabled(self) -> bool:
        """Whether the limiter can ever hold a call back."""
        return self.min_size_to_sample > 0 or self.samples_per_insert is not None

    @property
    def span(self) -> float:
        """``max_diff - min_diff``: the width of the window (``inf`` without a ratio)."""
        return self.max_diff - self.min_diff

    # ------------------------------------------------------------- decisions

    def can_insert(self, n: int) -> bool:
        """Whether an insert of ``n`` rows may go ahead now (Reverb's ``CanInsert``)."""
        if self.inserts + n - self.deletes <= self.min_size_to_sample:
            return True
        return (self.inserts + n) * self._spi - self.samples <= self.max_diff

    def can_sample(self, n: int) -> bool:
        """Whether a sample of ``n`` rows may go ahead now (Reverb's ``CanSample``)."""
        if self.inserts - self.deletes < self.min_size_to_sample:
            return False
        return self.inserts * self._spi - self.samples - n >= self.min_diff

    def check_insert(self, n: int, table: str, *, rows_can_leave: bool) -> None:
        """Raise unless an insert of ``n`` rows may go ahead now; change nothing.

        An insert blocked now can still pass later through the ratio rule only
        if ``n * spi`` fits the window (samples never take the count below
        ``min_diff``), or through the filling-up rule once the table is small
        enough, which needs a reset unless rows can leave otherwise.

        Args:
            n: rows to insert.
            table: the table's name, for messages.
            rows_can_leave: whether rows can leave the table other than by
                reset (``max_times_sampled``), so that the table can shrink.

        Raises:
            InvalidArgumentError: the insert can never pass, even into an
                empty table.
            FailedPreconditionError: it could pass only after a reset.
            RateLimitedError: it has to wait for samples.
        """
        if self.can_insert(n):
            return
        if n * self._spi > self.span:
            most = math.floor(self.span / self._spi)
            why = (f"table {table!r}: an insert of {n} rows moves the rate limiter's count by "
                   f"{n} * samples_per_insert = {n * self._spi:g}, more than its window of "
                   f"2 * error_buffer = {self.span:g}")
            advice = (f"insert at most {most} rows per call, or raise error_buffer to at least "
                      f"{n * self._spi / 2:g}")
            if n > self.min_size_to_sample and (
                n * self._spi > self.max_diff - min(0.0, self.min_diff)
            ):
                raise InvalidArgumentError(f"{why}, so it can never pass; {advice}")
            if not rows_can_leave:
                raise FailedPreconditionError(
                    f"{why}, and inserts are exempt only while they keep the table at most "
                    f"min_size_to_sample={self.min_size_to_sample} rows: it could pass only "
                    f"after a reset {self.describe()}; {advice}"
                )
        raise RateLimitedError(
            f"table {table!r}: insert of {n} rows blocked by the rate limiter {self.describe()}",
            table=table, operation="insert", count=n,
        )

    def check_sample(self, n: int, table: str) -> None:
        """Raise unless a sample of ``n`` rows may go ahead now; change nothing.

        Raises:
            InvalidArgumentError: ``n`` is wider than the window, so it can never pass.
            RateLimitedError: it has to wait for inserts.
        """
        if n > self.span:
            raise InvalidArgumentError(
                f"table {table!r}: a sample of {n} rows can never pass the rate limiter: "
                f"samples_per_insert={self.samples_per_insert:g} with error_buffer="
                f"{self.error_buffer:g} admits at most 2 * error_buffer = {self.span:g} rows "
                f"per call (a slice counts slice_len rows); sample fewer, or raise error_buffer"
            )
        if not self.can_sample(n):
            raise RateLimitedError(
                f"table {table!r}: sample of {n} rows blocked by the rate limiter "
                f"{self.describe()}",
                table=table, operation="sample", count=n,
            )

    # -------------------------------------------------------------- counting

    def inserted(self, n: int) -> None:
        self.inserts += n

    def sampled(self, n: int) -> None:
        self.samples += n

    def deleted(self, n: int) -> None:
        self.deletes += n

    def reset(self) -> None:
        """The table was emptied: every counter back to 0 (as Reverb does)."""
        self.inserts = self.samples = self.deletes = 0

    # ------------------------------------------------------------ reporting

    def describe(self) -> str:
        """``(inserts=..., samples=..., ...)``: the counters and settings, for messages."""
        ratio = (
            f"samples_per_insert={self.samples_per_insert:g}, error_buffer={self.error_buffer:g}"
            if self.samples_per_insert is not None and self.error_buffer is not None
            else "no ratio limit"
        )
        return (
            f"(inserts={self.inserts}, samples={self.samples}, deletes={self.deletes}, "
            f"size={self.inserts - self.deletes}, min_size_to_sample={self.min_size_to_sample}, "
            f"{ratio})"
        )

    def info(self) -> RateLimiterInfo:
        return RateLimiterInfo(
            enabled=self.enabled,
            min_size_to_sample=self.min_size_to_sample,
            samples_per_insert=self.samples_per_insert or 0.0,
            error_buffer=self.error_buffer or 0.0,
            min_diff=self.min_diff,
            max_diff=self.max_diff,
            inserts=self.inserts,
            samples=self.samples,
            deletes=self.deletes,
            can_insert=self.can_insert(1),
            can_sample=self.can_sample(1),
        )

    def state_dict(self) -> dict[str, Any]:
        """The counters (the settings come from the config at load)."""
        return {"inserts": self.inserts, "samples": self.samples, "deletes": self.deletes}

    def load_state_dict(self, state: dict[str, Any] | None, *, size: int) -> None:
        """Restore the counters of a table now holding ``size`` rows.

        ``None`` (a state saved before rate limiting existed): count the rows
        present as inserted, nothing sampled or deleted.

        Raises:
            ValueError: the counters are negative or do not add up to ``size``.
        """
        if state is None:
            state = {"inserts": size, "samples": 0, "deletes": 0}
        inserts, samples, deletes = (int(state[k]) for k in ("inserts", "samples", "deletes"))
        if min(inserts, samples, deletes) < 0 or inserts - deletes != size:
            raise ValueError(
                f"rate limiter counters inserts={inserts}, samples={samples}, deletes={deletes} "
                f"do not fit a table of {size} rows (inserts - deletes must equal its size)"
            )
        self.inserts, self.samples, self.deletes = inserts, samples, deletes
