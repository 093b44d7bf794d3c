"""What a name of shards resolves to: the addresses, and where known, every expected shard.

A plain name (``shards://NAME:PORT``) gives addresses only; with
``?expected=N`` it also gives the count; a registry (``ray://``) gives every
expected shard with its state. :mod:`replay_client.sharded.shard_set` uses the
count and the states to tell a whole replay from a part of one.
"""

from __future__ import annotations

from dataclasses import dataclass

STATES = ("starting", "serving", "restarting", "draining", "gone")
"""What a registry says of a shard; only a ``serving`` one is connected to."""


@dataclass(frozen=True)
class ShardState:
    """One expected shard as a registry knows it.

    Attributes:
        index: the shard's index (what its server reports, bits 56..62 of its ids).
        state: one of :data:`STATES`.
        address: where it serves (``None`` while it has no address).
        incarnation: how many times it has started (1 the first time).
    """

    index: int
    state: str
    address: str | None = None
    incarnation: int = 0

    def describe(self) -> str:
        at = f" at {self.address}" if self.address else ""
        return f"shard {self.index} is {self.state} (incarnation {self.incarnation}{at})"


@dataclass(frozen=True)
class Resolution:
    """What a name stands for now.

    Attributes:
        addresses: the servers to connect to (each one shard).
        expected: how many shards the replay has (indices ``0..expected-1``);
            ``None``: unknown (the servers found are the whole replay).
        shards: every expected shard with its state, where a registry knows them.
    """

    addresses: tuple[str, ...]
    expected: int | None = None
    shards: tuple[ShardState, ...] = ()

    def why_missing(self, index: int) -> str | None:
        """What the registry says of shard ``index`` (``None``: it says nothing)."""
        for shard in self.shards:
            if shard.index == index:
                return shard.describe()
        return None
