"""Call metadata both sides read: the declared request size.

A server reserves memory for a request *before* it reads it (see
``replay_server.service.budget``). The client says how large its request is
in the metadata :data:`REQUEST_BYTES_KEY` (for a stream: the largest message
it will send), so the server reserves exactly that; a unary call without it
is charged the full message-size limit while its request is read, a stream
:data:`STREAM_MESSAGE_BYTES`. A message larger than declared is refused.
"""

from __future__ import annotations

REQUEST_BYTES_KEY = "replay-request-bytes"
"""Metadata key: the request's size in bytes (a stream's largest message), as decimal text."""

STREAM_MESSAGE_BYTES = 1 << 16
"""What a learner declares for its SampleStream messages (a request, credits, answers)."""


def request_bytes_metadata(nbytes: int) -> tuple[tuple[str, str], ...]:
    """The metadata declaring a request of ``nbytes``."""
    return ((REQUEST_BYTES_KEY, str(nbytes)),)


def declared_request_bytes(metadata: object, default: int, most: int) -> int:
    """The size declared in ``metadata`` (pairs), at most ``most``; ``default`` when absent or
    malformed."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == REQUEST_BYTES_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return min(int(text), most) if text.isdigit() else default
    return default
