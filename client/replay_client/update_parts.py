"""Priority updates split into messages under the message limit.

An ``UpdatePrioritiesRequest`` carries every id and its priority in one
message: 16 bytes an id (an int64 and a float64, ``replay.proto``), so the
4 MiB default limit holds about 260,000 ids. A larger update (one large
call, or the queued ``wait=False`` updates merged while a call was in
flight, see :mod:`replay_client.updates`) goes out as several requests of at
most :func:`max_ids_per_message` ids each, in order; none is refused for its
size and no id is dropped.

Each part is applied as a whole by the server (a part with an id the table
never issued is refused, the parts before it stay applied). Parts of a slice
batch are whole slices: rows of ``[B, slice_len]`` ids stay rows, and flat
ids are cut at multiples of the ``step`` the caller gives (the table's
``slice_len``), so a table that mixes priorities per slice
(``priority_mixing``) always gets whole slices.

Cost: views of the caller's arrays, no copy. Thread-safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

ID_BYTES = 16
"""Bytes one id and its priority take in an UpdatePrioritiesRequest (int64 + float64)."""

HEADER_ROOM = 64 * 1024
"""Bytes kept free in each message for everything but the ids and priorities: the table's
name, the count, the shape, the field tags and the update stream's framing."""

MARGIN = 16
"""A further 1/MARGIN of the message kept free (gRPC's own framing, future fields)."""


def max_ids_per_message(message_bytes: int) -> int:
    """The most ids one update request of at most ``message_bytes`` bytes carries (>= 1).

    ``(message_bytes - HEADER_ROOM) / ID_BYTES``, less 1/MARGIN: 241,920 ids for 4 MiB.
    """
    usable = max(0, message_bytes - HEADER_ROOM) // ID_BYTES
    return max(1, usable - usable // MARGIN)


def update_parts(ids: np.ndarray, priorities: np.ndarray, max_ids: int, step: int = 1
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, priorities)`` in order, each part of at most ``max_ids`` ids where it can be.

    Args:
        ids: int64 ids, any shape; more than one dimension: split along the
            first (rows stay whole; ids whose single row holds more than
            ``max_ids`` are cut flat, as flat ids are).
        priorities: their priorities, the same shape.
        max_ids: the most ids a part should hold (:func:`max_ids_per_message`).
        step: flat ids are cut only at multiples of this (a slice table's
            ``slice_len``; 1: anywhere). A step larger than ``max_ids`` makes
            parts of one step.

    Yields:
        Views of ``ids`` and ``priorities``; exactly ``ids`` when it fits.
    """
    if ids.size <= max_ids:
        yield ids, priorities
        return
    if ids.ndim > 1:
        row = int(np.prod(ids.shape[1:]))
        if row and row <= max_ids:
            rows = max_ids // row
            for start in range(0, ids.shape[0], rows):
                yield ids[start:start + rows], priorities[start:start + rows]
            return
    flat_ids, flat_priorities = ids.reshape(-1), priorities.reshape(-1)
    step = max(1, int(step))
    size = max(step, max_ids // step * step)
    for start in range(0, flat_ids.size, size):
        yield flat_ids[start:start + size], flat_priorities[start:start + size]
