"""Reverb's rate limiter: when a table may take inserts and give samples.

A rate limiter keeps three counters, all in rows: ``inserts``, ``samples``
(rows returned by samples; a slice of ``slice_len`` steps counts
``slice_len``) and ``deletes`` (rows that left the table: overwritten by the
ring, or retired by ``max_times_sampled``), so ``inserts - deletes`` is the
table's size. Reset sets all three to 0. Reverb's two rules
(``reverb/cc/rate_limiter.cc``) say whether ``n`` more rows may go in or out::

    can_sample(n):  inserts - deletes >= min_size_to_sample
                    and inserts * spi - samples - n >= min_diff
    can_insert(n):  inserts + n - deletes <= min_size_to_sample      # filling up: free
                    or (inserts + n) * spi - samples <= max_diff

with ``spi = samples_per_insert`` and, as Reverb's ``SampleToInsertRatio``
does for a single ``error_buffer``::

    min_diff = spi * min_size_to_sample - error_buffer
    max_diff = spi * min_size_to_sample + error_buffer

So once the table holds ``min_size_to_sample`` rows, the count
``inserts * spi - samples`` stays near ``spi * min_size_to_sample``: samples
wait when the learner runs ahead of the actors, inserts wait when the actors
run ahead. Without ``samples_per_insert`` it is Reverb's ``MinSize``: samples
wait for ``min_size_to_sample`` rows, inserts never wait (``min_diff = -inf``,
``max_diff = +inf``). A limiter with neither (``min_size_to_sample = 0``) lets
everything through but still counts, for ``info``.

**Whole calls.** Reverb admits one item at a time, so a request for many
items takes them as the rules allow. Here a call is stored or sampled whole,
so the limiter admits a call of ``n`` rows when Reverb would admit its *first*
row (``can_insert(1)``, ``can_sample(1)``), and the call's other rows go with
it. The count can therefore leave the window by at most one call: it stays
within ``[min_diff - (largest sample - 1), max_diff + (largest insert - 1) * spi]``
once the table has filled up. The other choice, admitting a call only when
all its rows fit, would keep the count inside the window but could deadlock:
an insert waiting for samples while a sample waits for inserts, whenever
``n * spi + batch_size > 2 * error_buffer``, something the server cannot rule
out because it does not know its callers' sizes. With first-row admission no
combination of call sizes deadlocks, for the same reason Reverb's per-item
rule does not: ``error_buffer >= max(1, spi)`` (checked by the config) leaves
room for one row one way or the other, and below ``min_size_to_sample`` rows
inserts are free.

**Size.** A table whose rows leave when sampled (``fifo``/``lifo``, or
``max_times_sampled``) may also have a ``max_size`` (Reverb's ``Queue``
limiter): an insert of ``n`` rows waits while the table holds more than
``max_size - n`` rows, whole (the rows that must leave first are the
ones sampling takes), and an insert larger than ``max_size`` is refused.

A call held back raises :class:`~replay_server.errors.RateLimitedError`
(changing nothing); the table's caller decides whether to wait.

The limiter holds no reference to its table: the table calls it under its own
lock (check first, record after the change). Thread-safety: none of its own.
The ``can_*`` methods only read counters, so the service also calls them
without the lock, as a hint of whether a retry is worth it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from replay_proto.scalars import is_int, is_real
from replay_server.engine.options import LayerSpec, option
from replay_server.errors import ConfigError, InvalidArgumentError, RateLimitedError


DEFAULT_ERROR_ROWS = 1000
"""``error_buffer`` defaults to ``max(1, samples_per_insert) * max(min_size_to_sample, this)``."""

MAX_TIMES_SAMPLED = 2**32 - 1
"""Largest ``max_times_sampled`` (per-row counts are uint32)."""


@dataclass(frozen=True, kw_only=True)
class FlowControl(LayerSpec):
    """A table's rate limiter and row retirement: its options (checked alone; the table's
    config checks them against its sampler)."""

    min_size_to_sample: int | None = option(
        None, "samples wait until the table holds this many rows (Reverb's MinSize); unset: "
              "1 with samples_per_insert, else no rate limiter")
    samples_per_insert: float | None = option(
        None, "the ratio of sampled rows to inserted rows the rate limiter holds; unset: "
              "no ratio limit")
    error_buffer: float | None = option(
        None, "how far the ratio's count may drift either way before calls wait, in sampled "
              "rows (only with samples_per_insert); unset: "
              "max(1, samples_per_insert) * max(min_size_to_sample, 1000)")
    max_times_sampled: int = option(
        0, "a row (a slice's start) drawn this many times is retired; 0: no limit "
           "(fifo/lifo: 1)")
    max_size: int | None = option(
        None, "tables whose rows leave when sampled (fifo/lifo, or max_times_sampled): "
              "inserts wait while the table holds more than max_size - rows; unset: never")

    def check(self, where: str, capacity: int) -> None:
        """Refuse settings that can never make progress."""
        if self.min_size_to_sample is not None and (
                not is_int(self.min_size_to_sample)
                or not 1 <= self.min_size_to_sample <= capacity):
            raise ConfigError(
                f"{where}: min_size_to_sample must be an integer in [1, capacity={capacity}] "
                f"(the table never holds more than capacity rows, so sampling would wait "
                f"forever), got {self.min_size_to_sample!r}")
        spi = self.samples_per_insert
        if spi is not None:
            if not is_real(spi) or not math.isfinite(spi) or spi <= 0:
                raise ConfigError(
                    f"{where}: samples_per_insert must be a finite number > 0, got {spi!r}")
            self._set("samples_per_insert", float(spi))
        self._check_error_buffer(where)
        limit = self.max_times_sampled
        if not is_int(limit) or not 0 <= limit <= MAX_TIMES_SAMPLED:
            raise ConfigError(
                f"{where}: max_times_sampled must be an integer in [0, {MAX_TIMES_SAMPLED}] "
                f"(0: no limit), got {limit!r}")

    def _check_error_buffer(self, where: str) -> None:
        buffer, spi = self.error_buffer, self.samples_per_insert
        if buffer is None:
            return
        if spi is None:
            raise ConfigError(
                f"{where}: error_buffer={buffer!r} only applies with samples_per_insert; "
                f"set samples_per_insert or remove error_buffer")
        if not is_real(buffer) or not math.isfinite(buffer) or buffer <= 0:
            raise ConfigError(
                f"{where}: error_buffer must be a finite number > 0, got {buffer!r}")
        if buffer < max(1.0, spi):
            raise ConfigError(
                f"{where}: error_buffer={buffer!r} is below max(1, samples_per_insert="
                f"{spi!r}) = {max(1.0, spi)!r}: a single insert and a single sample could "
                f"then both be blocked at once, forever (Reverb's rule)")
        self._set("error_buffer", float(buffer))

    def check_max_size(self, where: str, capacity: int) -> None:
        if not is_int(self.max_size) or not 1 <= self.max_size <= capacity:
            raise ConfigError(f"{where}: max_size must be an integer in [1, capacity="
                              f"{capacity}] or omitted, got {self.max_size!r}")

    @property
    def rate_limited(self) -> bool:
        """Whether a rate limiter is configured (``min_size_to_sample``/``samples_per_insert``)."""
        return self.min_size_to_sample is not None or self.samples_per_insert is not None

    @property
    def effective_min_size_to_sample(self) -> int:
        """``min_size_to_sample`` with its default resolved (0: no rate limiter)."""
        if self.min_size_to_sample is not None:
            return self.min_size_to_sample
        return 1 if self.samples_per_insert is not None else 0

    @property
    def effective_error_buffer(self) -> float | None:
        """``error_buffer`` with its default resolved (``None``: no ratio limit)."""
        spi = self.samples_per_insert
        if spi is None:
            return None
        if self.error_buffer is not None:
            return self.error_buffer
        return max(1.0, spi) * max(self.effective_min_size_to_sample, DEFAULT_ERROR_ROWS)


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
        error_buffer: how far the count may move either way from
            ``spi * min_size_to_sample``; required with ``samples_per_insert``.
        max_size: rows the table may hold before inserts wait (``None``: no limit).

    Cost: every method O(1).
    """

    def __init__(
        self,
        min_size_to_sample: int = 0,
        samples_per_insert: float | None = None,
        error_buffer: float | None = None,
        max_size: int | None = None,
    ) -> None:
        if (samples_per_insert is None) != (error_buffer is None):
            raise ConfigError("samples_per_insert and error_buffer go together")
        self.min_size_to_sample = min_size_to_sample
        self.samples_per_insert = samples_per_insert
        self.error_buffer = error_buffer
        self.max_size = max_size
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
    def from_config(cls, config: Any) -> RateLimiter:
        """The limiter a table's config (its :class:`FlowControl`, ``config.flow``) describes
        (one that admits everything if it names none)."""
        flow: FlowControl = config.flow
        return cls(flow.effective_min_size_to_sample, flow.samples_per_insert,
                   flow.effective_error_buffer, flow.max_size)

    @property
    def enabled(self) -> bool:
        """Whether the limiter can ever hold a call back."""
        return self.min_size_to_sample > 0 or self.samples_per_insert is not None

    # ------------------------------------------------------------- decisions

    def can_insert(self, n: int) -> bool:
        """Reverb's ``CanInsert``: would ``n`` more rows keep within the rule?

        (A call is admitted when ``can_insert(1)``; see the module docstring.)
        """
        if self.inserts + n - self.deletes <= self.min_size_to_sample:
            return True
        return (self.inserts + n) * self._spi - self.samples <= self.max_diff

    def can_sample(self, n: int) -> bool:
        """Reverb's ``CanSample``: may ``n`` more rows be sampled within the rule?

        (A call is admitted when ``can_sample(1)``.)
        """
        if self.inserts - self.deletes < self.min_size_to_sample:
            return False
        return self.inserts * self._spi - self.samples - n >= self.min_diff

    def may_insert(self, n: int) -> bool:
        """Would an insert of ``n`` rows be admitted now (``max_size`` and the ratio)?"""
        fits = self.max_size is None or self.inserts - self.deletes + n <= self.max_size
        return fits and self.can_insert(1)

    def check_insert(self, n: int, table: str) -> None:
        """Raise unless an insert of ``n`` rows is admitted now (all of them fit ``max_size``
        and its first row is admitted by the ratio).

        Raises:
            InvalidArgumentError: ``n`` exceeds ``max_size``: it could never go in.
            RateLimitedError: it has to wait for samples; nothing changed.
        """
        size = self.inserts - self.deletes
        if self.max_size is not None:
            if n > self.max_size:
                raise InvalidArgumentError(
                    f"table {table!r}: an insert of {n} rows can never fit a table of "
                    f"max_size={self.max_size}; split it")
            if size + n > self.max_size:
                raise RateLimitedError(
                    f"table {table!r}: the table holds {size} of max_size={self.max_size} "
                    f"rows, no room for {n} more; it waits for samples",
                    table=table, operation="insert", count=n)
        if not self.can_insert(1):
            raise RateLimitedError(
                f"table {table!r}: insert of {n} rows blocked by the rate limiter "
                f"{self.describe()}",
                table=table, operation="insert", count=n,
            )

    def check_sample(self, n: int, table: str) -> None:
        """Raise unless a sample of ``n`` rows is admitted now (its first row can come out).

        Raises:
            RateLimitedError: it has to wait for inserts; nothing changed.
        """
        if not self.can_sample(1):
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
