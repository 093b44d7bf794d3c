"""The bit layout of a row id, the one place both sides read it.

A row id is a non-negative int64 made of three parts::

    bits 56..62  shard        7 bits   the server's ``shard`` index (0..127)
    bits 40..55  incarnation 16 bits   the id segment of the table that issued it
    bits  0..39  sequence    40 bits   rows issued in that segment before it

A sharded client routes an id to the shard :func:`shard_of` names; the
server makes ids with :func:`make_id` and reads them back (see
``replay_server.engine.id_space`` for segments and incarnations). Servers'
incarnations start at 1, so every id a server issues is at least
:data:`SEGMENT_ROWS` (``2**40``), above any storage position.

The helpers work on Python ints and on int64 numpy arrays or torch tensors
alike. Thread-safe (pure).
"""

from __future__ import annotations

from typing import Any

SHARD_BITS = 7
INCARNATION_BITS = 16
SEQUENCE_BITS = 40

INCARNATION_SHIFT = SEQUENCE_BITS
SHARD_SHIFT = SEQUENCE_BITS + INCARNATION_BITS
"""An id's shard index is ``id >> SHARD_SHIFT`` (56)."""

MAX_SHARDS = 1 << SHARD_BITS
"""How many shards ids can tell apart (128)."""

MAX_SHARD = MAX_SHARDS - 1
"""Largest shard index (127)."""

MAX_INCARNATION = (1 << INCARNATION_BITS) - 1
"""Largest incarnation (65535)."""

SEGMENT_ROWS = 1 << SEQUENCE_BITS
"""Rows one segment can issue (2**40); every id a server issues is at least this."""

SEQUENCE_MASK = SEGMENT_ROWS - 1


def make_id(shard: int, incarnation: int, sequence: int) -> int:
    """The id of row ``sequence`` of segment ``incarnation`` on ``shard``."""
    return (shard << SHARD_SHIFT) | (incarnation << INCARNATION_SHIFT) | sequence


def shard_of(ids: Any) -> Any:
    """The shard index of each id (an int, or an array of them)."""
    return ids >> SHARD_SHIFT


def incarnation_of(ids: Any) -> Any:
    """The incarnation of each id (an int, or an array of them)."""
    return (ids >> INCARNATION_SHIFT) & MAX_INCARNATION

