"""A sharded stream's parts: one shard's rows (credits back a group at a time) and the merge's
window rule (no server involved)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

from replay_client.sharded.health import ShardHealth
from replay_client.sharded.rows import ShardRows
from replay_client.sharded.stream import MergedLink
from replay_feed.credits import CreditFlow, CreditQueue
from replay_proto.batch import SampleBatch


class _ParkedLink:
    """A gRPC shard link whose call delivers one grouped view, then waits until stopped
    without reading its grants: the test reads them instead."""

    transport = "grpc"
    batches_per_message = 4

    def __init__(self, rows: int) -> None:
        ids = torch.arange(rows, dtype=torch.int64)
        self.view = SampleBatch.from_columns({"x": ids.clone()}, ids, torch.ones(rows),
                                             torch.ones(rows, dtype=torch.float64))
        self.flow = None
        self.delivered = threading.Event()
        self.released = threading.Event()

    def call(self, flow, credits, updates, remaining, first):  # type: ignore[no-untyped-def]
        self.flow = flow
        yield self.view
        self.delivered.set()  # the shard's thread has stored the view
        self.released.wait(10)

    def stop(self) -> None:
        self.released.set()

    def close(self) -> None:
        pass


def test_freed_chunks_credits_go_back_a_group_at_a_time_and_all_while_the_merge_waits() -> None:
    link = _ParkedLink(12)  # one message of 6 chunks of 2 rows
    cond = threading.Condition()
    rows = ShardRows(0, link, cond, window=8, chunk_rows=2, mass=None, reconnect=False,
                     retry_window_s=1.0, name="shard 0")
    rows.start()
    try:
        assert link.delivered.wait(10)

        def freed(count: int) -> int:
            """Take ``count`` rows, finish with them; the credits sent for it."""
            with cond:
                _, hold = rows.take(count)
                rows.done(hold)
            return link.flow.next_grant(block=False).credits

        assert rows.available == 12
        assert freed(2) == 0  # 1 chunk free: held for the group
        assert freed(6) == 4  # 4 free: the group's credits in one grant
        assert freed(2) == 0
        with cond:
            rows.flush()  # the merge waits for this shard's rows: what is free goes now
        assert link.flow.next_grant(block=False).credits == 1
    finally:
        rows.stop()
        rows.join(5.0)


def test_a_grouped_view_counts_every_chunk_it_holds_as_arrived() -> None:
    link = _ParkedLink(12)
    rows = ShardRows(0, link, threading.Condition(), window=8, chunk_rows=2, mass=None,
                     reconnect=False, retry_window_s=1.0, name="shard 0")
    rows.start()
    try:
        assert link.delivered.wait(10)
        # A call reopened now may have 8 - 6 chunks drawn (one per view would say 7).
        credits, _ = link.flow.opening()
        assert credits == 2
    finally:
        rows.stop()
        rows.join(5.0)


def test_the_learners_window_does_not_grow_while_a_shard_reads_a_ring() -> None:
    """A ring's slots are fixed: a wider learner window would let the merge wait for rows
    that only batches the learner gives back later could free (the stream hung)."""

    def make(shard: int, cond: threading.Condition) -> SimpleNamespace:
        transport = "shared_memory" if shard == 0 else "grpc"
        return SimpleNamespace(link=SimpleNamespace(transport=transport), mass=None,
                               start=lambda: None)

    link = MergedLink(lambda: {0: "a", 1: "b"}, make, 4, beta=None, masses={},
                      staging=None, when_released=None, copy=None,  # type: ignore[arg-type]
                      generator=np.random.default_rng(0), rng_lock=threading.Lock(),
                      refresh=lambda shard: None, health=ShardHealth(), degraded=False,
                      wait=True, wait_timeout=None)
    link.call(CreditFlow(CreditQueue(), 2), 2, [], 0, 0)  # starts both shards' rows
    assert not link.may_grow()
    link._rows[0].link.transport = "grpc"  # the shard fell back to gRPC
    assert link.may_grow()
