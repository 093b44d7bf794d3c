"""The queue benchmark's workload, shared by replay-server's and Reverb's sides (numpy only).

Small rows (17 float32, 68 bytes), a queue that holds at most ``QUEUE_MAX``
rows (inserts wait when it is full), batches of ``BATCH`` taken in order.
"""

from __future__ import annotations

import numpy as np

ROW_SPEC = {"obs": ((17,), "float32")}
QUEUE_MAX = 10_000
BATCH = 256
ROWS = 200_000       # rows inserted and consumed per measurement (at most)
SECONDS = 20.0       # time bound of each measurement


def make_rows(n: int) -> np.ndarray:
    """``n`` rows of 17 float32 whose first value is the row's number (to check the order)."""
    rows = np.random.default_rng(0).standard_normal((n, 17)).astype(np.float32)
    rows[:, 0] = np.arange(n)
    return rows
