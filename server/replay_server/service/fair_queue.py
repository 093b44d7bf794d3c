"""A queue served in turn per peer: first come first served within a peer, round robin across peers.

What waits for memory (:class:`~replay_server.service.budget.MemoryBudget`)
waits here, keyed by the caller's address (its host, without the port: one
machine opening many connections is one peer). Room that frees is offered to
the head of each peer's line in turn, the peer served longest ago first, and
a peer that was just served goes to the back. So one address with many
waiting calls gets one grant per round, like an address with one: it cannot
starve another however many calls it queues (issue 34: reservations are
granted fairly so one caller cannot hold a budget others wait for).

Cost: O(1) to push and to serve a head; :meth:`FairQueue.heads` is O(peers);
:meth:`FairQueue.remove` is O(waiters of that peer). Not thread-safe: one
event loop owns a queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items waiting per peer (see the module docstring)."""

    def __init__(self) -> None:
        self._peers: OrderedDict[str, deque[T]] = OrderedDict()  # served longest ago first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, peer: str, item: T) -> None:
        """Queue ``item`` at the back of ``peer``'s line (a new peer joins the round last)."""
        line = self._peers.get(peer)
        if line is None:
            line = self._peers[peer] = deque()
        line.append(item)
        self._count += 1

    def heads(self) -> list[tuple[str, T]]:
        """Each peer's first item, in the order they are to be offered room."""
        return [(peer, line[0]) for peer, line in self._peers.items()]

    def served(self, peer: str) -> None:
        """``peer``'s first item got what it waited for (or gave up): it leaves the line,
        and the peer goes to the back of the round."""
        line = self._peers[peer]
        line.popleft()
        self._count -= 1
        if line:
            self._peers.move_to_end(peer)
        else:
            del self._peers[peer]

    def remove(self, peer: str, item: T) -> bool:
        """Take ``item`` out of ``peer``'s line (it stopped waiting); False if not there."""
        line = self._peers.get(peer)
        if line is None:
            return False
        try:
            line.remove(item)
        except ValueError:
            return False
        self._count -= 1
        if not line:
            del self._peers[peer]
        return True
