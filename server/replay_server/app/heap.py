"""The server process' heap: large request buffers reused instead of faulted in afresh.

Every insert reaches the server as one message of up to ``max_message_mb``
(7 MB for 256 Atari rows), which gRPC copies into new ``bytes`` objects on
the event loop. With glibc's defaults those buffers kept landing in fresh
pages: its mmap threshold adapts to the last large block freed, and its trim
threshold (twice that) hands the top of the heap back to the kernel as soon
as a request is freed, so the next request's copy page-faults (and the
kernel zeroes) all of its memory again. Measured on the Atari ``Writer``
benchmark (10,240 rows, a fresh table, the standalone server): 2.3x the page
faults of the same run with the heap kept, and the faults were most of the
server's system time.

:func:`keep_request_buffers` fixes both thresholds for the standalone server
process: blocks under :data:`MMAP_THRESHOLD_BYTES` come from the heap, and
up to :data:`TRIM_THRESHOLD_BYTES` of freed heap stays mapped for the next
request. Cost: at most that much memory the process has used and freed stays
resident (it is reused by the next large request, never grown past). Under
an address-space limit (``ulimit -v``) it also caps glibc's heap arenas
(:data:`ARENAS_UNDER_ADDRESS_LIMIT`). Only ``replay-server serve`` calls
it: an embedded server shares the user's process, whose allocator is the
user's business.

Thread-safety: call once at start, before the server's threads exist.
"""

from __future__ import annotations

import ctypes
import logging
import resource
import sys

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest allowed threshold on 64-bit)."""

TRIM_THRESHOLD_BYTES = 128 << 20
"""Freed memory at the top of the heap kept mapped, up to this much, for the next request."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

ARENAS_UNDER_ADDRESS_LIMIT = 2
"""glibc heaps (arenas) kept when the address space is limited: each new thread's arena
otherwise maps 64 MiB, which under ``ulimit -v`` runs out long before memory does."""

log = logging.getLogger("replay_server")


def keep_request_buffers() -> bool:
    """Set the heap thresholds (see the module docstring); False where there is no glibc ``mallopt``.

    Returns:
        True if both thresholds were set.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process' own symbols: no ldconfig subprocess
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        if mallopt(_M_ARENA_MAX, ARENAS_UNDER_ADDRESS_LIMIT) == 1:
            log.info("address space limited (ulimit -v): at most %d heap arenas",
                     ARENAS_UNDER_ADDRESS_LIMIT)
    applied = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
               and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not applied:
        log.info("heap thresholds not set (mallopt refused): large requests are faulted in "
                 "afresh")
    return applied
