"""Credits and the updates made between them, as a link forwards them (no server involved)."""

from __future__ import annotations

import threading

import numpy as np

from replay_feed.credits import RIDE_MAX_IDS, CreditFlow, CreditQueue, PriorityUpdate


def update(*ids: int) -> PriorityUpdate:
    return PriorityUpdate(np.array(ids, dtype=np.int64), np.ones(len(ids)))


def test_updates_ride_on_the_next_credit_in_the_order_made() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=2)
    assert flow.opening() == (2, [])
    queue.update(update(1))
    queue.update(update(2))
    assert flow.next_grant(block=False) == flow.next_grant(block=False)  # held: nothing to send
    queue.credit()
    grant = flow.next_grant()
    assert grant.credits == 1 and [u.ids.tolist() for u in grant.updates] == [[1], [2]]


def test_without_riding_updates_go_at_once() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=1, ride=False)
    queue.update(update(7))
    grant = flow.next_grant()
    assert grant.credits == 0 and grant.updates[0].ids.tolist() == [7]


def test_a_call_reopened_grants_only_the_room_left_and_carries_unsent_updates() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=3)
    assert flow.opening()[0] == 3
    flow.arrived(3)  # the window is full: the consumer holds 3 batches
    queue.update(update(4))
    queue.credit()
    grant = flow.next_grant()
    flow.unsent(grant)  # the call broke before this grant could be sent
    credits, updates = flow.opening()
    assert credits == 1 and updates[0].ids.tolist() == [4]


def test_opening_waits_for_room_and_growth_widens_the_window() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=1)
    flow.opening()
    flow.arrived(1)
    opened: list = []
    thread = threading.Thread(target=lambda: opened.append(flow.opening()))
    thread.start()
    queue.credit()  # the consumer finished a batch: room for one
    thread.join(10)
    assert opened == [(1, [])]
    flow.grow(2)
    assert flow.next_grant().credits == 2 and flow.window == 3


def test_stop_sends_what_is_held_once_then_ends() -> None:
    released: list = []
    queue = CreditQueue(release=released.append)
    flow = CreditFlow(queue, window=1)
    queue.update(update(9))
    assert flow.next_grant(block=False).updates == []  # held for a credit
    queue.credit("token")
    queue.stop()
    grant = flow.next_grant()  # stopping: no more batches, but the update still goes
    assert grant.updates[0].ids.tolist() == [9]
    assert released == ["token"]
    assert flow.next_grant() is None and queue.take() is None


def test_held_updates_go_without_a_credit_once_they_are_many() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=1)
    for start in range(0, RIDE_MAX_IDS, 1024):
        queue.update(update(*range(start, start + 1024)))
    grant = flow.next_grant()
    assert grant.credits == 0 and sum(u.ids.size for u in grant.updates) == RIDE_MAX_IDS


def test_finished_batches_are_counted_in_order_and_ride_with_the_credits() -> None:
    """A leased stream reports the batches its learner finished (replay_client.stream)."""
    queue = CreditQueue()
    flow = CreditFlow(queue, window=2)
    flow.opening()
    queue.credit(None, finished=False)  # the first take: nothing finished yet
    queue.credit(None, finished=True)   # the second: the first batch is finished
    grant = flow.next_grant()
    assert grant.credits == 2 and grant.finished == 1 and flow.finished == 1
    queue.update(update(3))
    queue.finish()                      # ack(): finished, no credit; the update goes with it
    grant = flow.next_grant()
    assert grant.credits == 0 and grant.finished == 1 and grant.updates
    assert flow.finished == 2


def test_a_finish_made_while_stopping_is_still_sent() -> None:
    queue = CreditQueue()
    flow = CreditFlow(queue, window=1)
    queue.finish()
    queue.stop()
    grant = flow.next_grant()
    assert grant is not None and grant.finished == 1
    assert flow.next_grant() is None


def test_a_reopened_call_grants_at_most_the_window_while_the_consumer_waits() -> None:
    """A learner waiting in next() has granted the credit of the batch it waits for; a call
    reopened then opens with the window, no more (a ring is sized by it)."""
    queue = CreditQueue()
    flow = CreditFlow(queue, window=2)
    assert flow.opening()[0] == 2
    flow.arrived(2)
    for _ in range(3):  # took both, and asked for a third that never came (the call was lost)
        queue.credit()
    assert flow.next_grant().credits == 3
    assert flow.opening()[0] == 2
