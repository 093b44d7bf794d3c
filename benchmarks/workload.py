"""The engine benchmark's workload, shared by every implementation it compares.

Both sides of ``benchmarks/engine.py`` (replay-server's engine in our virtualenv,
TorchRL in its own) import this module, so they store the same rows, in the same
order, and time the same operations. It depends on torch only.

A row is a small continuous-control transition: 17 float32 observations, a
float32 reward, a bool ``done`` and an int64 ``episode`` id. Episodes are
``EPISODE_LEN`` steps long and laid out contiguously (TorchRL's SliceSampler
needs contiguous trajectories; replay-server does not, which only favours
TorchRL here).
"""

from __future__ import annotations

import ctypes
import gc

import torch

OBS_DIM = 17
EPISODE_LEN = 250
FILL_CHUNK = 1_000_000
ALPHA = 0.6
BETA = 0.4
SLICE_LEN = 32
SLICE_BATCH = 256
SLICE_INSERT_ROWS = 1_000

PRIORITIZED_ROWS = (1_000_000, 10_000_000)
PRIORITIZED_BATCHES = (256, 65_536)
SLICE_ROWS = (1_000_000, 10_000_000, 50_000_000)
INSERT_ROWS_PER_CALL = (1_000, 100_000)
MEMORY_ROWS = 10_000_000

# Raw bytes of one row: what a user would count (17*4 + 4 + 1), without the episode id.
ROW_BYTES_NO_EPISODE = OBS_DIM * 4 + 4 + 1


def make_rows(first_row: int, n: int) -> dict[str, torch.Tensor]:
    """Rows ``first_row .. first_row + n - 1`` of the benchmark's stream.

    Deterministic in ``first_row`` so every implementation sees the same data.
    Episode ``k`` holds rows ``k * EPISODE_LEN .. (k + 1) * EPISODE_LEN - 1``.
    """
    row = torch.arange(first_row, first_row + n, dtype=torch.int64)
    g = torch.Generator().manual_seed(first_row)
    return {
        "obs": torch.randn(n, OBS_DIM, generator=g),
        "reward": torch.randn(n, generator=g),
        "done": (row % EPISODE_LEN) == EPISODE_LEN - 1,
        "episode": row // EPISODE_LEN,
    }


def new_priorities(n: int, seed: int) -> torch.Tensor:
    """Positive priorities like |TD error| + eps, for priority updates."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) * 2.0 + 1e-3


def resident_bytes(trim: bool) -> int:
    """This process's resident set size after a GC, optionally after ``malloc_trim(0)``.

    Trimming hands freed heap pages back to the OS, so the figure counts live
    memory only, not the fill's freed temporaries that glibc keeps around.
    """
    import psutil

    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss
