"""The client's use of :class:`~replay_feed.options.StreamOptions`: built once, errors typed.

Both clients' ``stream`` take ``options`` and keywords; this is where they
become one checked ``StreamOptions`` and a feed, and where a bad option
becomes :class:`~replay_client.errors.InvalidArgumentError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay_client.errors import InvalidArgumentError
from replay_feed.core import FeedCore
from replay_feed.options import StreamOptions, StreamOptionsError


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
