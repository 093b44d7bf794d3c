"""The credit-driven skeleton's loops, with links made here (no server involved)."""

from __future__ import annotations

import numpy as np
import torch

from replay_feed.credits import CreditFlow, CreditQueue, PriorityUpdate
from replay_feed.link import LinkLost, LinkRunner, drawn_here
from replay_proto.batch import SampleBatch


def batch(rows: int) -> SampleBatch:
    ids = torch.arange(rows, dtype=torch.int64)
    return SampleBatch.from_columns({"x": ids.clone()}, ids, torch.ones(rows),
                                    torch.ones(rows, dtype=torch.float64))


def test_a_link_drawing_in_groups_draws_what_the_credits_allow_in_one_pass() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=5)
    credits, updates = flow.opening()
    events: list[tuple] = []

    def draw_group(index: int, most: int) -> list[SampleBatch]:
        events.append(("draw", index, most))
        return [batch(2) for _ in range(min(most, 3))]  # the link's group: 3 at most

    def apply(updates: list[PriorityUpdate]) -> None:
        events.extend(("apply", u.ids.tolist()) for u in updates)

    calls = drawn_here(flow, credits, updates, 6, 0, apply=apply, draw=lambda k: None,
                       stopped=lambda: False, draw_group=draw_group)
    got = [next(calls) for _ in range(3)]  # one pass: three batches
    # The learner updates priorities, then takes a batch (its credit): the next pass sees both.
    queue.update(PriorityUpdate(np.array([9], dtype=np.int64), np.ones(1)))
    queue.credit()
    got += list(calls)
    assert len(got) == 6  # the 5 credits of the opening and the one granted after
    assert events == [("draw", 0, 5), ("apply", [9]), ("draw", 3, 3)]


def test_a_link_drawing_in_groups_stops_at_remaining() -> None:
    flow = CreditFlow(CreditQueue(), window=8)
    credits, updates = flow.opening()
    asked: list[int] = []

    def draw_group(index: int, most: int) -> list[SampleBatch]:
        asked.append(most)
        return [batch(1) for _ in range(most)]

    calls = drawn_here(flow, credits, updates, 3, 10, apply=lambda u: None,
                       draw=lambda k: None, stopped=lambda: False, draw_group=draw_group)
    assert len(list(calls)) == 3 and asked == [3]


class _GroupedThenLost:
    """A link whose first call delivers two views of 4 credits each, then loses its
    connection; later calls record the credits they open with and end."""

    transport = "grpc"

    def __init__(self) -> None:
        self.opened_with: list[int] = []
        self.runner: LinkRunner | None = None

    def call(self, flow, credits, updates, remaining, first):  # type: ignore[no-untyped-def]
        self.opened_with.append(credits)
        if len(self.opened_with) == 1:
            yield batch(8)
            yield batch(8)
            raise LinkLost(ConnectionError("lost"), lambda window: ConnectionError("gone"))
        assert self.runner is not None
        self.runner.stop()

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_call_reopened_after_grouped_views_grants_only_the_room_left() -> None:
    link = _GroupedThenLost()
    flow = CreditFlow(CreditQueue(), window=10)
    runner = LinkRunner(link, flow, retry_window_s=5.0,
                        credits_of=lambda b: b.batch_size // 2)  # chunks of 2 rows
    link.runner = runner
    assert len(list(runner.batches())) == 2
    # 8 of the 10 credits were used by the two views and none was given back: the new call
    # may have 2 chunks drawn, not 8 (a runner counting one per view would over-grant).
    assert link.opened_with == [10, 2]
