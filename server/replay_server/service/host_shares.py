"""Shares of the call pools per source address: one place cannot take every slot.

:class:`~replay_server.service.admission.Admission` has three pools of slots,
each with a global cap: working calls (``max_concurrent_calls``), waiting calls
(``max_waiting_calls``) and streams within the waiting pool (``max_streams``).
A global cap alone lets one source address take a whole pool: one host whose
clients never read their answers held every working slot until
``response_timeout_s`` dropped them, one that opened 128 streams and idled held
every stream slot, and every other host was refused meanwhile.

``server.max_host_share`` (a fraction in (0, 1]) caps what the calls of one
address (the gRPC peer's host, its port left out:
:func:`~replay_server.service.peer_log.peer_host`) may hold of each pool at
once: ``max(1, floor(max_host_share x cap))`` slots. A call past its address's
share is refused before anything of it is read, as past a global cap
(RESOURCE_EXHAUSTED, :class:`~replay_server.service.status.OverloadedError`),
naming the address, what it holds and the setting. So the address holding the
most is the one refused first: with the default 0.75, a flood from one place
leaves a quarter of every pool to everyone else. ``1.0`` turns the shares off
(a deployment whose clients all come through one address: a NAT, a node proxy,
or every actor on the server's own host).

Cost: O(1) per call (a dict lookup and an increment). The table holds only
addresses that have a call admitted now: an entry is removed when its counts
fall to 0, so it never grows with addresses that left.

Thread-safety: event-loop only, like :class:`~replay_server.service.admission.Admission`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replay_server.service.status import OverloadedError


@dataclass(frozen=True, slots=True)
class Pool:
    """One of admission's pools: its index in a host's counts, its setting and its noun."""

    index: int
    setting: str
    noun: str


WORKING = Pool(0, "max_concurrent_calls", "working calls")
WAITING = Pool(1, "max_waiting_calls", "waiting calls")
STREAMS = Pool(2, "max_streams", "streams")


def share_of(share: float, cap: int) -> int:
    """Slots one address may hold of a pool of ``cap``: at least 1, at most ``cap``."""
    return min(cap, max(1, math.floor(share * cap + 1e-9)))  # 0.29 x 100 is 28.999...


class HostShares:
    """What each source address holds of each pool, and its share (see the module docstring).

    Args:
        share: ``server.max_host_share``, in (0, 1].
        caps: the pools' caps, in the order of :data:`WORKING`, :data:`WAITING`,
            :data:`STREAMS`.

    Attributes:
        refused: calls refused for their address's share since start.
    """

    def __init__(self, share: float, caps: tuple[int, int, int]) -> None:
        self.share = share
        self._caps = caps
        self._most = tuple(share_of(share, cap) for cap in caps)
        self._held: dict[str, list[int]] = {}
        self.refused = 0

    def most(self, pool: Pool) -> int:
        """Slots of ``pool`` one address may hold."""
        return self._most[pool.index]

    def held(self, host: str) -> tuple[int, int, int]:
        """What ``host`` holds of each pool now."""
        counts = self._held.get(host)
        return (0, 0, 0) if counts is None else (counts[0], counts[1], counts[2])

    def hosts(self) -> int:
        """Addresses holding a slot now (the table's size)."""
        return len(self._held)

    def refusal(self, name: str, host: str, pool: Pool, what: str) -> OverloadedError | None:
        """Why a call ``name`` from ``host`` may not take a slot of ``pool`` now, if it may
        not (counted in :attr:`refused`); ``what`` says what was not done ("the call was not
        run")."""
        counts = self._held.get(host)
        held = 0 if counts is None else counts[pool.index]
        most = self._most[pool.index]
        if held < most:
            return None
        self.refused += 1
        return OverloadedError(
            f"{name}: {host} holds {held} of server.{pool.setting} = "
            f"{self._caps[pool.index]} {pool.noun} already (server.max_host_share = "
            f"{self.share:g}: one address may hold {most}); {what}: try again later (a "
            f"deployment whose clients all come through one address sets "
            f"server.max_host_share = 1.0)")

    def take(self, host: str, pool: Pool) -> None:
        """``host`` holds one more slot of ``pool``."""
        counts = self._held.get(host)
        if counts is None:
            counts = self._held[host] = [0, 0, 0]
        counts[pool.index] += 1

    def give(self, host: str, pool: Pool) -> None:
        """``host`` holds one slot of ``pool`` less (its entry goes when it holds none)."""
        counts = self._held[host]
        counts[pool.index] -= 1
        if not any(counts):
            del self._held[host]
