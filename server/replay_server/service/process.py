"""Figures of the server process itself, for ``info`` (the metrics use prometheus_client's)."""

from __future__ import annotations

import os


def rss_bytes() -> int:
    """Resident memory of this process now, in bytes (0 where ``/proc`` is missing).

    Cost: one small read of ``/proc/self/statm``.
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
