"""``ShardRows``: one shard's part of a sharded stream, its drawn rows waiting for the merge.

Each shard of a sharded stream runs its own ``SampleStream``
(:class:`~replay_client.stream.SampleLink`: gRPC, or a shared-memory ring
for a shard on this host) with its own credit window, on a thread of its
own, through the skeleton every stream uses
(:class:`~replay_feed.link.LinkRunner`: reconnects included). Its batches
are *chunks* of ``chunk_rows`` iid draws from that shard, kept as they
arrived (views of the gRPC message or of the ring slot: nothing is copied
here). The merge takes as many rows as its split gives the shard, in
order, and copies them once, into the learner's batch (or, when one shard's
whole chunk is the batch, hands the chunk over as it is); a chunk's credit
goes back to the shard only once all its rows were copied (or the learner
gave the batch back), so a ring slot is never rewritten under a view.
Over gRPC, freed chunks' credits go back a group at a time (the chunks the
shard's server sends per message, its ``batches_per_message``), so the
server draws and sends full groups instead of a chunk per credit; while the
merge waits for this shard's rows, every freed chunk's credit goes at once
(:meth:`ShardRows.flush`), so holding credits back never holds the merge up
for long and can never leave it waiting for rows the server was not allowed
to draw.

Rows drawn ahead are iid draws made when the shard drew them: merging
``k`` of them is drawing ``k`` (``replay_client.sharded.merge``). A shard
whose share is small keeps its rows longer; at most its window of chunks.

Thread-safety: the shard's thread appends, the merge takes, both under
the stream's one condition (``cond``), which also wakes the merge.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from replay_feed.credits import CreditFlow, CreditQueue, PriorityUpdate
from replay_feed.link import Link, LinkRunner
from replay_proto.batch import SampleBatch
from replay_proto.mass import SamplingMass


class ShardRows:
    """One shard's stream of drawn rows (see the module docstring).

    Args:
        shard: the shard's index.
        link: its SampleStream, delivering views.
        cond: the stream's condition (shared by every shard and the merge).
        window: chunks in flight or buffered at most (the shard's credit window).
        chunk_rows: rows per chunk (one credit).
        mass: the shard's mass when the stream opened (``None``: not known).
        reconnect: reopen a lost call within ``retry_window_s`` (else fail at once).
        retry_window_s: how long reconnecting may go on.
        name: for the log (the shard and its address).
        probe: a left-out shard tried again: fail at once (no reconnecting, so no log
            line per try) until its first rows arrive, then reconnect as asked.
    """

    def __init__(self, shard: int, link: Link, cond: threading.Condition, *, window: int,
                 chunk_rows: int, mass: SamplingMass | None, reconnect: bool,
                 retry_window_s: float | Callable[[], float], name: str,
                 probe: bool = False) -> None:
        self.shard = shard
        self.link = link
        self.chunk_rows = chunk_rows
        self.mass = mass
        self._cond = cond
        self._credits = CreditQueue()
        self._reconnect = reconnect
        self._runner = LinkRunner(link, CreditFlow(self._credits, window, ride=False),
                                  reconnect=reconnect and not probe,
                                  retry_window_s=retry_window_s, name=name,
                                  credits_of=self._chunks_in)
        self._segments: deque[list] = deque()  # [batch, rows taken from it]
        self._rows = 0
        self._taken = 0
        self._released = 0      # chunks whose rows are all done
        self._credited = 0      # credits sent for them
        self._holds: deque[list] = deque()  # [rows taken up to, done], in order
        self.error: BaseException | None = None
        self.ended = False
        self.arrivals = 0
        self.last_arrival = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"replay-shard-{shard}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._runner.batches():
                with self._cond:
                    self._segments.append([batch, 0])
                    self._rows += batch.batch_size
                    if batch.mass is not None:
                        self.mass = batch.mass
                    if not self.arrivals:
                        self._runner.reconnect = self._reconnect  # a probe that answered
                    self.arrivals += 1
                    self.last_arrival = time.monotonic()
                    self._cond.notify_all()
        except BaseException as exc:  # the merge raises it, or leaves the shard out
            with self._cond:
                self.error = exc
                self._cond.notify_all()
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def _chunks_in(self, batch: SampleBatch) -> int:
        """Chunks (credits) one delivered view holds: a grouped message's are one view."""
        return max(1, -(-batch.batch_size // self.chunk_rows))

    @property
    def available(self) -> int:
        """Rows arrived and not taken (under ``cond``)."""
        return self._rows

    def take(self, count: int) -> tuple[list[SampleBatch], list]:
        """The next ``count`` rows, as views, and the hold on them (under ``cond``;
        ``count <= available``): their chunks' credits wait until :meth:`done` with it."""
        pieces = []
        while count:
            entry = self._segments[0]
            batch, start = entry
            n = min(count, batch.batch_size - start)
            pieces.append(batch if n == batch.batch_size else batch.rows(start, start + n))
            entry[1] += n
            if entry[1] == batch.batch_size:
                self._segments.popleft()
            count -= n
            self._rows -= n
            self._taken += n
        hold = [self._taken, False]
        self._holds.append(hold)
        return pieces, hold

    def done(self, hold: list) -> None:
        """The rows of ``hold`` are no longer read (copied out, or the learner gave back the
        batch they were handed over in): a credit for each chunk all of whose rows, and all
        earlier ones, are done. Holds end in any order; credits go in order, so a ring slot
        is never rewritten under a view. Under ``cond``."""
        hold[1] = True
        while self._holds and self._holds[0][1]:
            free = self._holds.popleft()[0] // self.chunk_rows
            self._released = max(self._released, free)
        if self._released - self._credited >= self.credit_group:
            self.flush()

    @property
    def credit_group(self) -> int:
        """Freed chunks whose credits go back together: the chunks the shard's server sends
        per message over gRPC (one on shared memory, where each chunk is a ring slot)."""
        if self.link.transport != "grpc":
            return 1
        return max(1, int(getattr(self.link, "batches_per_message", 1)))

    def flush(self) -> None:
        """Send the credits of every freed chunk now (the merge waits for this shard's rows).
        Under ``cond``."""
        for _ in range(self._released - self._credited):
            self._credits.credit()
        self._credited = self._released

    def grow(self, chunks: int) -> None:
        """Widen the shard's window (over gRPC only: a ring's slots are fixed)."""
        if chunks > 0 and self.link.transport == "grpc":
            self._runner.flow.grow(chunks)

    def update(self, update: PriorityUpdate) -> None:
        """A priority update of this shard's ids: sent at once (its credits come only as the
        merge uses its rows), before its next credits."""
        self._credits.update(update)

    def stop(self) -> None:
        self._credits.stop()
        self._runner.stop()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.link.close()

