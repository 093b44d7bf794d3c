"""The id bit layout both sides read: shard | incarnation | sequence."""

from __future__ import annotations

import numpy as np

from replay_proto.id_layout import (
    MAX_INCARNATION,
    MAX_SHARD,
    MAX_SHARDS,
    SEGMENT_ROWS,
    SEQUENCE_MASK,
    incarnation_of,
    make_id,
    shard_of,
)


def split_id(row_id: int) -> tuple[int, int, int]:
    """``(shard, incarnation, sequence)`` of a non-negative id."""
    return shard_of(row_id), incarnation_of(row_id), row_id & SEQUENCE_MASK


def test_the_parts_fill_a_non_negative_int64() -> None:
    largest = make_id(MAX_SHARD, MAX_INCARNATION, SEGMENT_ROWS - 1)
    assert largest == 2**63 - 1
    assert split_id(largest) == (127, 65535, 2**40 - 1)
    assert MAX_SHARDS == 128 and split_id(make_id(3, 17, 5)) == (3, 17, 5)


def test_arrays_split_like_ints() -> None:
    ids = np.array([make_id(0, 1, 0), make_id(5, 2, 9), make_id(127, 3, 4)], dtype=np.int64)
    assert shard_of(ids).tolist() == [0, 5, 127]
    assert incarnation_of(ids).tolist() == [1, 2, 3]
    assert (ids >= SEGMENT_ROWS).all()  # incarnations >= 1: above every storage position
