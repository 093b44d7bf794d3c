"""``ShardProber``: down shards asked again in the background, so no caller waits on them.

A degraded sharded client leaves a down shard out of its calls
(:mod:`replay_client.sharded.health`). Were a caller's call the one to try
it again, every retry of a hung shard would cost that caller the per-shard
deadline (:mod:`replay_client.sharded.deadline`). Instead one daemon thread
per client probes each down shard at its retry time (backing off as the
health record says, 0.5 s doubling to 10 s) with one short ``Info`` call;
a shard that answers has rejoined and the next call includes it.

Cost: one thread while some shard is down (it ends when none is), one probe
per down shard per retry. Thread-safety: :meth:`watch` and :meth:`close`
from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from replay_client.sharded.health import ShardHealth

Ask = Callable[[int], "str | None"]
"""Probes one shard: ``None`` if it answered, else why not."""

_IDLE_WAIT_S = 1.0  # how long the thread waits for a shard to watch before it ends


class ShardProber:
    """Background probes of down shards (see the module docstring).

    Args:
        health: the client's record of down shards and their retry times.
        ask: probes one shard (at most the per-shard deadline).
    """

    def __init__(self, health: ShardHealth, ask: Ask) -> None:
        self._health = health
        self._ask = ask
        self._cond = threading.Condition(threading.Lock())
        self._watched: set[int] = set()
        self._thread: threading.Thread | None = None

    def watch(self, shard: int) -> None:
        """Probe ``shard`` (down now, left to the probe) until it answers."""
        with self._cond:
            self._watched.add(shard)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="replay-shard-probe",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop probing what is watched (a probe in flight finishes on its own deadline; the
        thread ends soon after). A later :meth:`watch` starts again."""
        with self._cond:
            self._watched.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            due = self._next_due()
            if due is None:
                return
            for shard in due:
                why = self._ask(shard)
                with self._cond:
                    if shard not in self._watched:  # closed meanwhile
                        continue
                    if why is None:
                        self._watched.discard(shard)
                        self._health.answered([shard])
                    else:
                        self._health.failed(shard, why, probed=True)

    def _next_due(self) -> list[int] | None:
        """Wait until some watched shard is due; ``None``: nothing left to watch (the thread
        ends)."""
        with self._cond:
            while True:
                if not self._watched:
                    self._cond.wait(_IDLE_WAIT_S)
                    if not self._watched:
                        self._thread = None
                        return None
                    continue
                now = time.monotonic()
                times = {s: self._health.retry_at(s) for s in self._watched}
                for shard in [s for s, at in times.items() if at is None]:
                    self._watched.discard(shard)  # it rejoined by a call meanwhile
                due = [s for s, at in times.items() if at is not None and at <= now]
                if due:
                    return due
                later = [at for at in times.values() if at is not None]
                if later:
                    self._cond.wait(min(later) - now)
