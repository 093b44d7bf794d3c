"""Calls a connection opens and abandons before they say anything: the rapid-reset meter.

An HTTP/2 client may open a stream (HEADERS) and cancel it at once
(RST_STREAM), as often as it likes, on one connection: the "rapid reset"
attack (CVE-2023-44487). gRPC core (1.85) bounds the streams open at once,
not the rate, and each such stream still starts a handler here: 100,000
resets on one connection took legitimate calls' median from 1.5 ms to
225 ms, with errors. gRPC offers no limit on the rate, so the server counts
per connection the calls their client ends before their first message
arrived (a reset), and a connection past ``server.max_call_resets_per_s``
of them within one second is cut (the connection guard shuts its socket:
:meth:`~replay_server.service.connections.ConnectionGuard.cut`). A client
cancelling calls it has sent, or a learner closing its stream, never counts,
nor does a call the server ends itself (refused for memory, or past
``request_timeout_s``: :class:`~replay_server.service.admission.Admission`
marks those as spoken).
On a server requiring the token, every call refused for its token counts
too (:mod:`~replay_server.service.token_auth`): such calls never reach
admission, and a reset flood without the token otherwise lasted until the
connection's handshake deadline.

Cost: a dictionary update per such call; the table is emptied each second,
so it holds at most the connections that ended a call without a word in
the current second. Thread-safety: event loop only.
"""

from __future__ import annotations

import time


class ResetMeter:
    """Per connection, calls ended without a word in the current second (see the module docstring).

    Args:
        limit_per_s: how many a connection may end so within one second.

    Attributes:
        cut: connections found over the limit so far.
    """

    def __init__(self, limit_per_s: float) -> None:
        self.limit = limit_per_s
        self.cut = 0
        self._second = -1
        self._counts: dict[str, int] = {}

    def ended_silent(self, peer: str, now: float | None = None) -> bool:
        """A call of connection ``peer`` (gRPC's peer string: address and port) ended before
        its first message; whether the connection just went over the limit (said once per
        second)."""
        second = int(time.monotonic() if now is None else now)
        if second != self._second:
            self._second, self._counts = second, {}
        count = self._counts[peer] = self._counts.get(peer, 0) + 1
        if count == int(self.limit) + 1:
            self.cut += 1
            return True
        return False
