"""How every handler runs its engine work: off the event loop, admitted, waited, mapped.

:class:`CallRunner` is the one collaborator the unary handlers and the
``SampleStream`` handler share. It refuses new work while the server is
restoring or draining (UNAVAILABLE), runs engine work in the bounded engine
pool (never on the event loop), lets calls a table's rate limiter holds back
wait in :class:`~replay_server.service.waiting.BlockedCalls` (holding no
thread), reports every table change there so waiters wake, and ends a
failed call with its status (:func:`~replay_server.service.status.abort`).

Thread-safety: event-loop only (the work itself runs in the pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, NoReturn, TypeVar

import grpc

from replay_server.service.status import ShuttingDownError, abort
from replay_server.service.waiting import BlockedCalls, Hint

T = TypeVar("T")


class CallRunner:
    """Runs calls' engine work; see the module docstring.

    Args:
        executor: the engine's bounded thread pool.
        hint: cheap, lock-free guess whether a rate-limited call would pass now.

    Attributes:
        restoring: set while tables are restored at start (calls are refused).
        blocked: where rate-limited calls wait (its counts feed ``info``).
        start_waiting: told a call is about to wait, before it does (the admission
            moves it to the waiting pool, or raises OverloadedError to refuse it).
        default_wait_s: how long a unary call whose client set no deadline may wait
            (``None``: as long as it takes).
    """

    def __init__(self, executor: Executor, hint: Hint) -> None:
        self.executor = executor
        self.blocked = BlockedCalls(hint)
        self.restoring = False
        self.start_waiting: Callable[[grpc.aio.ServicerContext], None] = lambda _context: None
        self.default_wait_s: float | None = None
        self.on_drain: list[Callable[[], None]] = []
        """Called (on the loop) when draining starts, so waiters of other kinds give up too."""
        self._draining = False

    @property
    def draining(self) -> bool:
        """Set when the server starts draining: new calls are refused, waiting ones give up."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:
            self.blocked.changed()
            for wake in self.on_drain:
                wake()

    def refusal(self) -> ShuttingDownError | None:
        """Why new work is refused now (UNAVAILABLE): draining, or still restoring at start."""
        if self._draining:
            return ShuttingDownError("the server is shutting down")
        if self.restoring:
            return ShuttingDownError(
                "the server is restoring its tables from a checkpoint; try again shortly")
        return None

    async def run(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any,
                  executor: Executor | None = None) -> T:
        """``fn(*args)`` in the pool (or ``executor``); its errors end the call with their status."""
        refused = self.refusal()
        if refused is not None:
            await abort(context, refused)
        loop = asyncio.get_running_loop()
        return await self.settle(context, loop.run_in_executor(executor or self.executor, fn, *args))

    async def change(self, context: grpc.aio.ServicerContext, fn: Callable[..., tuple[str, T]],
                     *args: Any, aborting: bool = True,
                     time_remaining: Callable[[], float | None] | None = None) -> T:
        """Run ``fn`` (returning ``(table, result)``) in the pool, waiting while it is
        rate-limited; then report the table changed and return ``result``.

        Errors end the call with their status, or propagate (``aborting=False``).
        ``time_remaining``: how long it may wait (default: until the call's deadline; a
        unary call, ``aborting``, without one: :attr:`default_wait_s`). A call about to
        wait is first reported to :attr:`start_waiting`.
        """
        refused = self.refusal()
        if refused is not None:
            if aborting:
                await abort(context, refused)
            raise refused
        if time_remaining is None:
            time_remaining = (self.deadline_or_default(context) if aborting
                              else context.time_remaining)
        loop = asyncio.get_running_loop()
        work = self.blocked.run(
            lambda: loop.run_in_executor(self.executor, fn, *args),
            time_remaining=time_remaining,
            stopping=lambda: self._draining,
            on_block=lambda: self.start_waiting(context),
        )
        table, result = await (self.settle(context, work) if aborting else work)
        self.blocked.changed(table)
        return result

    def deadline_or_default(self, context: grpc.aio.ServicerContext) -> Callable[[], float | None]:
        """Seconds a unary call may still wait: to its deadline, else :attr:`default_wait_s`."""

        def remaining() -> float | None:
            left = context.time_remaining()
            return self.default_wait_s if left is None else left

        return remaining

    async def settle(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        """The result of engine work, with its errors turned into the call's status."""
        try:
            return await work
        except Exception as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    async def fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
        """End the call with ``exc``'s status."""
        await abort(context, exc)
