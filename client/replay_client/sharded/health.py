"""Which shards a degraded-mode client leaves out for now, and when it tries them again.

By default a sharded client fails a call when a shard is unavailable (the
error names the shard). With ``allow_degraded=True`` it goes on without it:
a shard whose call failed with :class:`~replay_client.errors.UnavailableError`
(down, restarting, draining) is *down*: calls leave it out until its retry
time, which backs off from ``first_retry_s`` to ``max_retry_s``; the first
call after that time includes it again (a probe), and if the shard answers it
has *rejoined*. A shard a sharded client's one-shot calls found down
(unavailable, or silent past its per-shard deadline,
:mod:`replay_client.sharded.deadline`) is instead *probed*: calls leave it
out until a probe in the background (:mod:`replay_client.sharded.prober`)
finds it answering, so no caller waits on it meanwhile. :class:`ShardStats`
counts what happened, for dashboards and tests (``client.shard_stats()``).

Thread-safety: all methods take the object's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class ShardStats:
    """What degraded mode has done since the client was made.

    Attributes:
        down: shards left out now, with the error that put each out.
        failures: calls to a shard that failed as unavailable.
        rejoins: times a down shard answered again.
        degraded_samples: batches drawn without every shard (their
            probabilities and weights are over the live shards' rows).
        degraded_inserts: inserts placed on live shards only (and inserts
            resent there after their shard failed).
        skipped_updates: priority updates not sent because their shard was down.
    """

    down: dict[int, str] = field(default_factory=dict)
    failures: int = 0
    rejoins: int = 0
    degraded_samples: int = 0
    degraded_inserts: int = 0
    skipped_updates: int = 0


class ShardHealth:
    """Down shards and their retry times (see the module docstring)."""

    def __init__(self, first_retry_s: float = 0.5, max_retry_s: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._first = first_retry_s
        self._max = max_retry_s
        self._retry_at: dict[int, float] = {}
        self._delay: dict[int, float] = {}
        self._probed: set[int] = set()
        self._stats = ShardStats()

    def live(self, shards: Iterable[int]) -> list[int]:
        """``shards`` that are up, or down but due for a retry (and not left to a background
        probe), in the order given."""
        now = time.monotonic()
        with self._lock:
            return [s for s in shards
                    if s not in self._probed and self._retry_at.get(s, 0.0) <= now]

    def retry_at(self, shard: int) -> float | None:
        """When ``shard`` is due for its next try (``time.monotonic()``); ``None``: it is up."""
        with self._lock:
            return self._retry_at.get(shard) if shard in self._stats.down else None

    def failed(self, shard: int, reason: str, *, probed: bool = False) -> None:
        """A call to ``shard`` failed as unavailable: leave it out until its next retry time
        (``probed``: until a background probe finds it answering)."""
        with self._lock:
            if probed:
                self._probed.add(shard)
            delay = min(self._delay.get(shard, self._first / 2) * 2, self._max)
            self._delay[shard] = delay
            self._retry_at[shard] = time.monotonic() + delay
            self._stats.down[shard] = reason
            self._stats.failures += 1

    def answered(self, shards: Iterable[int]) -> None:
        """``shards`` answered a call: those that were down have rejoined."""
        with self._lock:
            for shard in shards:
                self._probed.discard(shard)
                if shard in self._stats.down:
                    del self._stats.down[shard]
                    self._retry_at.pop(shard, None)
                    self._delay.pop(shard, None)
                    self._stats.rejoins += 1

    def retired(self, shards: Iterable[int]) -> None:
        """``shards`` left the replay (a scale down): no longer down, and not rejoined."""
        with self._lock:
            for shard in shards:
                self._probed.discard(shard)
                self._stats.down.pop(shard, None)
                self._retry_at.pop(shard, None)
                self._delay.pop(shard, None)

    @property
    def any_down(self) -> bool:
        """Whether some shard is down now."""
        with self._lock:
            return bool(self._stats.down)

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to the :class:`ShardStats` counter ``what``."""
        with self._lock:
            setattr(self._stats, what, getattr(self._stats, what) + n)

    def stats(self) -> ShardStats:
        """A copy of the counts now."""
        with self._lock:
            s = self._stats
            return ShardStats(dict(s.down), s.failures, s.rejoins, s.degraded_samples,
                              s.degraded_inserts, s.skipped_updates)


def down_note(down: set[int]) -> str:
    """What an empty replay's error adds about shards it could not ask (their rows may be
    all there is): nothing when every shard answered."""
    if not down:
        return ""
    listed = ", ".join(str(s) for s in sorted(down))
    return f"; shard{'s' if len(down) > 1 else ''} {listed} down, not counted"
