"""The client's use of :class:`~replay_feed.options.StreamOptions`: built once, errors typed.

Both clients' ``stream`` take ``options`` and keywords; this is where they
become one checked ``StreamOptions`` and a feed, and where a bad option
becomes :class:`~replay_client.errors.InvalidArgumentError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from replay_client.errors import InvalidArgumentError
from replay_feed.core import FeedCore
from replay_feed.options import RECONNECT_S, StreamOptions, StreamOptionsError


class _Reachable(Protocol):
    """What :func:`reconnect_window` asks of a connection."""

    answered: bool
    max_retry_s: float

    def retry_window(self) -> float: ...


def stream_options(options: StreamOptions | None, keywords: Mapping[str, Any]) -> StreamOptions:
    """``options`` with ``keywords`` set, checked.

    Raises:
        InvalidArgumentError: an unknown keyword or a bad value (named).
    """
    try:
        return StreamOptions.build(options, **keywords)
    except StreamOptionsError as exc:
        raise InvalidArgumentError(str(exc)) from None


def feed_core(window: int, options: StreamOptions) -> FeedCore:
    """The feed of a stream with ``window`` batches ahead of the learner.

    Raises:
        InvalidArgumentError: the device or pinning asked for is not available here.
    """
    try:
        return FeedCore(window, options.delivery(), options.transform)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def reconnect_window(options: StreamOptions, connection: _Reachable) -> Callable[[], float]:
    """Seconds a lost stream over ``connection`` keeps trying to resume, asked when it is
    lost: ``options.reconnect_s``, else the longer of :data:`RECONNECT_S` and the client's
    ``max_retry_s``; a server that never answered this client gets the client's window (a
    wrong address fails as fast as any call)."""

    def window() -> float:
        if options.reconnect_s is not None:
            return options.reconnect_s
        if not connection.answered:
            return connection.retry_window()
        return max(RECONNECT_S, connection.max_retry_s)

    return window
