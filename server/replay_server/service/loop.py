"""The event loop, chosen in one place: uvloop when installed, else asyncio's own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the chosen kind, for a server run on a thread of its own (the
    embedded server: a Ray shard, a learner's process)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on the chosen event loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
