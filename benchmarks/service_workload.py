"""The service benchmark's workload, shared by replay-server's and Reverb's sides.

Both sides of ``benchmarks/service.py`` import this module (it needs only
numpy), so they store the same rows and time the same operations: each server
runs in its own process, one client process drives it over loopback.

Two row kinds:

* ``atari``: an Atari frame stack (84x84x4 uint8), an int32 action, a float32
  reward and a bool done: 28,233 bytes per row.
* ``small``: 17 float32 observations: 68 bytes per row.
"""

from __future__ import annotations

import numpy as np

ROW_KINDS = ("atari", "small")
CAPACITY = {"atari": 50_000, "small": 1_000_000}
SAMPLE_BATCH = 256
INSERT_ROWS = {"atari": 20_000, "small": 200_000}   # rows inserted per insert measurement
UPDATE_BATCH = 1_024                                 # ids per priority-update call (default)
UPDATE_BATCHES = (128, 1_024)                        # ids per call, each measured
ALPHA = 0.6
BETA = 0.4
POLICY_PARAMS = {"atari": 1_700_000, "small": 20_000}  # float32 parameters of a policy (DQN's Atari
                                                     # network; a small MLP), for publish/fetch
SECONDS = 10.0                                       # time bound of each measurement


def row_spec(kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (per-row shape, numpy dtype name)}``."""
    if kind == "atari":
        return {
            "obs": ((84, 84, 4), "uint8"),
            "action": ((), "int32"),
            "reward": ((), "float32"),
            "done": ((), "bool"),
        }
    if kind == "small":
        return {"obs": ((17,), "float32")}
    raise ValueError(f"unknown row kind {kind!r}")


def row_bytes(kind: str) -> int:
    return sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        for shape, dtype in row_spec(kind).values()
    )


def make_rows(kind: str, first_row: int, n: int) -> dict[str, np.ndarray]:
    """Rows ``first_row .. first_row + n - 1`` as columns (leading dim = rows)."""
    rng = np.random.default_rng(first_row)
    out = {}
    for key, (shape, dtype) in row_spec(kind).items():
        if dtype == "uint8":
            out[key] = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
        elif dtype == "bool":
            out[key] = rng.random((n, *shape)) < 0.01
        elif dtype.startswith("int"):
            out[key] = rng.integers(0, 18, size=(n, *shape)).astype(dtype)
        else:
            out[key] = rng.standard_normal((n, *shape)).astype(dtype)
    return out


def new_priorities(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.random(n) * 2.0 + 1e-3).astype(np.float64)
