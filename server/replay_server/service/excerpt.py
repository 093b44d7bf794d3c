"""Bounded text: what a client sent is quoted in errors and logs only up to a limit.

A table name of 8 MiB once made an 8 MiB log line, and an error listing
400,000 variable names became a status message no client could receive
(over gRPC's 8 KiB metadata limit, so the client saw a size error instead of
the typed one). Everything the server says about a call goes through
:func:`excerpt` first.

Pure functions; any thread.
"""

from __future__ import annotations

STATUS_CHARS = 2048
"""Longest status message a call is answered with (well within gRPC's 8 KiB of trailers)."""

LOG_VALUE_CHARS = 1024
"""Longest value (a message, a name, an address) a log line about a client quotes."""

LOG_LINE_CHARS = 16384
"""Longest log line (tracebacks included) the server writes."""


def excerpt(text: object, limit: int) -> str:
    """``str(text)`` if at most ``limit`` characters, else its head and how long it was.

    Cost: O(limit) for long text (the rest is never copied).
    """
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return text
    note = f"... ({len(text):,} characters in all)"
    return text[: max(0, limit - len(note))] + note
