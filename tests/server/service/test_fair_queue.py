"""fair_queue: first come first served within a peer, round robin across peers."""

from __future__ import annotations

from replay_server.service.fair_queue import FairQueue


def drain(queue: FairQueue[str]) -> list[str]:
    order = []
    while len(queue):
        peer, item = queue.heads()[0]
        order.append(item)
        queue.served(peer)
    return order


def test_peers_are_served_in_turn_and_each_peer_in_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.push("a", f"a{i}")
    queue.push("b", "b0")
    queue.push("c", "c0")
    queue.push("b", "b1")
    assert [item for _, item in queue.heads()] == ["a0", "b0", "c0"]
    assert drain(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_removed_item_leaves_its_line_and_an_empty_line_its_peer() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a0")
    queue.push("b", "b0")
    assert queue.remove("a", "a0") and not queue.remove("a", "a0") and not queue.remove("z", "x")
    assert len(queue) == 1 and queue.heads() == [("b", "b0")]
