"""What a learner sends on a SampleStream: its first message checked, and its priority updates applied.

See :mod:`replay_server.service.sample_stream` for the protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import Table
from replay_server.errors import InvalidArgumentError

MAX_CREDITS = 1024
"""Largest prefetch window a learner may grant in its first message."""


async def messages_until(event: asyncio.Event, timeout_s: float,
                         done: Callable[[], bool]) -> None:
    """Event loop, once a stream's last batch was sent: let the learner's messages come in
    (``event`` is set on each) until ``done()`` holds or ``timeout_s`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        event.clear()
        left = deadline - loop.time()
        if done() or left <= 0:
            return
        try:
            await asyncio.wait_for(event.wait(), left)
        except TimeoutError:
            return


def update_table(table: Table, update: pb.UpdatePrioritiesRequest) -> tuple[str, int]:
    """Engine pool: ``update`` applied to ``table``; how many ids named stored rows."""
    ids, priorities = messages.update_arrays(update)
    applied = table.update_priorities(ids, priorities)
    return table.name, int(applied or 0)


def parse_first(raw: bytes) -> pb.SampleStreamRequest:
    try:
        first = pb.SampleStreamRequest.FromString(raw)
    except Exception as exc:
        raise InvalidArgumentError(f"malformed SampleStreamRequest: {exc}") from None
    if not first.HasField("request"):
        raise InvalidArgumentError("the first SampleStream message must carry `request`")
    request = first.request
    for name in ("num_batches", "batches_per_message"):
        if getattr(request, name) < 0:
            raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(request, name)}")
    if not 1 <= first.credits <= MAX_CREDITS:
        raise InvalidArgumentError(
            f"the first SampleStream message must grant credits in [1, {MAX_CREDITS}] (the "
            f"prefetch window), got {first.credits}")
    if not 0 <= first.window <= MAX_CREDITS:
        raise InvalidArgumentError(
            f"the first SampleStream message's window must be in [0, {MAX_CREDITS}], got "
            f"{first.window}")
    return first
