"""What each layer of a table allocates per slot, as plain formulas (no torch).

The ledger promises a table its layers' per-slot state at capacity before
anything is allocated (:mod:`replay_server.engine.table_memory`), and
``check-config`` reports the same promise without building a table, so the
sizes live here, in plain Python (no numpy either); the layers allocate with
the dtypes named here (:func:`index_dtype`, :func:`count_dtype`).
"""

from __future__ import annotations

SUMTREE_SLOT_BYTES = 7
"""Bytes per slot a sum tree is promised: float32 leaves, float64 nodes per block, minima."""

NSTEP_SLOT_BYTES = 26
"""Bytes per slot of the n-step reader: its links and the stored rewards' running sums."""

COMPRESSED_SLOT_BYTES = 12
"""Bytes per slot of an lz4-compressed column in RAM: each row's block offset and size."""

FRAMESTACK_SLOT_BYTES = 16
"""Bytes per slot of the frame-stack reader: each slot's episode links."""

_COUNTS = (("uint8", 1), ("uint16", 2), ("uint32", 4))
"""The unsigned dtypes a count may have, narrowest first, with their sizes."""


def index_dtype(capacity: int) -> str:
    """The narrowest integer dtype (numpy's name) that holds any slot of ``capacity``."""
    return "int32" if capacity < 2**31 else "int64"


def index_bytes(capacity: int) -> int:
    """Bytes of one :func:`index_dtype` value."""
    return 4 if index_dtype(capacity) == "int32" else 8


def count_dtype(limit: int) -> str:
    """The narrowest unsigned dtype (numpy's name) that holds counts up to ``limit``."""
    return _count(limit)[0]


def _count(limit: int) -> tuple[str, int]:
    for name, size in _COUNTS:
        if limit < 1 << (8 * size):
            return name, size
    raise ValueError(f"limit {limit} exceeds uint32")


def slotset_bytes(capacity: int) -> int:
    """Bytes per slot of a slot set of ``capacity`` slots (members and their positions)."""
    return 2 * index_bytes(capacity)


def heads_bytes(capacity: int) -> int:
    """Bytes per slot of the episode heads of ``capacity`` slots (a flag, and a slot set)."""
    return 1 + slotset_bytes(capacity)


def remover_slot_bytes(limit: int) -> int:
    """Bytes per slot of a remover that retires rows after ``limit`` draws (one count)."""
    return _count(limit)[1]
