"""Logging about clients, rate-limited per peer, so one client cannot flood the log.

A client that repeats a mistake (malformed requests, a wrong token, a
shared-memory ring it keeps refusing) or keeps triggering the same failure
would otherwise write one line per call: tens of thousands of lines a
second, drowning everything else and filling disks. :class:`PeerLog` lets
through at most ``burst`` lines per peer (client host) and topic (a kind of
refusal, say) per ``window_s``; the lines it holds back are counted and
reported in one line when the window ends and that peer is heard from again.

Peers are keyed by host (``ipv4:10.0.0.7``; the port changes with every
connection), and at most ``max_peers`` (host, topic) pairs are tracked (the
least recently heard from is forgotten first), so the bookkeeping itself is
bounded.

The limit is also global: at most ``total`` lines about all clients together
per window, so a client rotating its source address (2,000 addresses once
wrote 9,976 lines in 18 s) gets no more lines than ``total``; the rest are
counted, and one line reports them when the window ends. Every argument of a
line is cut to :data:`~replay_server.service.excerpt.LOG_VALUE_CHARS`
(an 8 MiB table name made an 8 MiB line).

Thread-safety: any thread (a lock guards the counts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from replay_server.service.excerpt import LOG_VALUE_CHARS, excerpt

BURST = 5
"""Lines per peer per window."""

WINDOW_S = 60.0
"""The window, in seconds."""

MAX_PEERS = 1024
"""Peers tracked at once."""

TOTAL = 100
"""Lines about all peers together per window."""


@dataclass(slots=True)
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


def peer_host(peer: str | None) -> str:
    """``"ipv4:10.0.0.7"`` of ``"ipv4:10.0.0.7:53412"`` (``"ipv6:[::1]"`` of ``"ipv6:[::1]:5"``)."""
    if not peer:
        return "unknown"
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() and head.count(":") >= 1 else peer


class PeerLog:
    """Rate-limited logging per peer (see the module docstring).

    Args:
        logger: where lines go.
        burst: lines per peer per window.
        window_s: the window.
        max_peers: peers tracked at once.
    """

    def __init__(self, logger: logging.Logger, *, burst: int = BURST,
                 window_s: float = WINDOW_S, max_peers: int = MAX_PEERS,
                 total: int = TOTAL) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._max_peers = max_peers
        self._total = total
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()
        self._all = _Window(time.monotonic())
        self._lock = threading.Lock()

    @property
    def tracked(self) -> int:
        """(host, topic) pairs tracked now."""
        with self._lock:
            return len(self._windows)

    def log(self, peer: str | None, topic: str, level: int, message: str, *args: object,
            exc_info: BaseException | None = None) -> bool:
        """Log ``message % args`` about ``peer`` unless its window for ``topic`` is used up;
        True if logged."""
        if not self._logger.isEnabledFor(level):
            return False
        host = excerpt(peer_host(peer), LOG_VALUE_CHARS)
        key = (host, topic)
        now = time.monotonic()
        summary = everyone = 0
        with self._lock:
            if now - self._all.start >= self._window_s:
                everyone, self._all = self._all.suppressed, _Window(now)
            window = self._windows.get(key)
            if window is None or now - window.start >= self._window_s:
                summary = window.suppressed if window is not None else 0
                window = _Window(now)
                self._windows[key] = window
            self._windows.move_to_end(key)
            while len(self._windows) > self._max_peers:
                self._windows.popitem(last=False)
            if summary:  # a line too: within the global limit, or counted there
                if self._all.logged < self._total:
                    self._all.logged += 1
                else:
                    self._all.suppressed += summary
                    summary = 0
            allowed = window.logged < self._burst and self._all.logged < self._total
            if allowed:
                window.logged += 1
                self._all.logged += 1
            else:
                window.suppressed += 1
                self._all.suppressed += 1
            last_for_all = allowed and self._all.logged == self._total
        if everyone:
            self._logger.warning("%d more messages about clients were not logged in the last "
                                 "%.0f s (at most %d a window)", everyone, self._window_s,
                                 self._total)
        if summary:
            self._logger.log(level, "%d more messages about %s (%s) were not logged in the last "
                             "%.0f s", summary, host, topic, self._window_s)
        if allowed:
            suffix = (" (more about this peer in the next %.0f s are counted, not logged)"
                      if window.logged == self._burst else
                      " (more about any client in the next %.0f s are counted, not logged)"
                      if last_for_all else "")
            cut = tuple(excerpt(a, LOG_VALUE_CHARS) if isinstance(a, str) or not isinstance(
                a, (int, float)) else a for a in args)
            self._logger.log(level, excerpt(message, LOG_VALUE_CHARS) + suffix, *cut,
                             *((self._window_s,) if suffix else ()), exc_info=exc_info)
        return allowed
