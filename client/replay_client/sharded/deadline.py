"""Per-shard deadlines: a shard that answers neither a call nor a probe in time counts as down.

A shard can fail without failing fast: a server that accepts connections
and never speaks (a hung process, a black-holed route) holds every call to
it for the call's whole timeout, and a sharded call waits for its slowest
shard. So a sharded client gives each shard ``shard_deadline_s`` (2 s by
default) to answer its part of a call. A shard still silent then is asked a
probe (``Info``, which a live server answers in milliseconds however long
the call itself takes: a sample held by the rate limiter, a large insert)
that has another ``shard_deadline_s`` to answer:

* the probe answers (even with an error, say overloaded: the server spoke):
  the shard is alive and merely slow; the call is waited
  for as long as its own timeout allows, as before;
* neither the call nor the probe has answered: the shard is *late*, and its
  part of the call fails with :class:`~replay_client.errors.UnavailableError`
  naming it. A degraded client then treats it as any unavailable shard
  (down: inserts go to the others, samples list it in ``missing_shards``,
  it is probed again in the background, :mod:`replay_client.sharded.prober`);
  a strict client raises that error.

So a sharded call returns within twice the per-shard deadline plus a
scheduling margin, whatever one shard does. The abandoned call runs on in
its pool thread until its own timeout (the pool has room for that); a call
to one shard made on the caller's thread is watched alike and cancelled
instead (:mod:`replay_client.sharded.lanes`).

Cost: nothing while every shard answers within the deadline; a probe per
late shard otherwise. Thread-safety: :func:`settle` may be called from any
thread; it only waits on futures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from replay_client.errors import DeadlineExceededError, ReplayError, UnavailableError
from replay_proto.scalars import is_real
from replay_proto.v1 import replay_pb2 as pb

DEFAULT_SHARD_DEADLINE_S = 2.0
"""Seconds a shard has to answer its part of a call before it is probed (``shard_deadline_s``)."""

Probe = Callable[[int], "Future | None"]
"""Starts a probe of a shard (a future that succeeds if it answered); ``None``: cannot probe."""

_INFO_REQUEST = pb.InfoRequest().SerializeToString()


def check_deadline(value: Any) -> float:
    """``shard_deadline_s`` validated: a number of seconds > 0.

    Raises:
        ValueError: anything else (the caller raises its typed error).
    """
    if not is_real(value) or not 0 < value < float("inf"):
        raise ValueError(f"shard_deadline_s must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def probe_call(client: Any, deadline_s: float) -> Callable[[], Any] | None:
    """The probe of one shard's client: one ``Info`` call of at most ``deadline_s``, not
    retried; ``None`` for a client without a connection (a custom factory's)."""
    connection = getattr(client, "connection", None)
    if connection is None or not hasattr(connection, "unary"):
        return None
    return lambda: connection.unary("Info", _INFO_REQUEST, retry=False, retry_unsent=False,
                                    timeout=deadline_s)


def settle(futures: Mapping[int, Future], deadline_s: float, probe: Probe,
           where: Callable[[int], str]) -> dict[int, Any]:
    """Each shard's result, or the :class:`ReplayError` it failed with, by shard.

    Shards that answer neither their call within ``deadline_s`` nor, after that,
    a probe within ``deadline_s`` more get an :class:`UnavailableError` (late);
    their calls are left running. ``where(shard)`` names a shard in that error.
    """
    outcomes: dict[int, Any] = {}
    _wait_all(futures.values(), deadline_s)
    late = {s: f for s, f in futures.items() if not f.done()}
    probes = {s: probe(s) for s in late}
    alive = {s for s, p in probes.items() if p is None}  # cannot probe: wait as before
    dead: set[int] = set()  # the probe failed: no need to wait out the deadline
    end = time.monotonic() + deadline_s
    while True:
        open_calls = [s for s in late if s not in alive | dead and not late[s].done()]
        watching = [late[s] for s in open_calls] + [
            p for s in open_calls if (p := probes[s]) is not None and not p.done()]
        if not open_calls or not watching:
            break
        left = end - time.monotonic()
        if left <= 0:
            break
        wait(watching, timeout=left, return_when=FIRST_COMPLETED)
        for shard in open_calls:
            answer = probes[shard]
            if answer is not None and answer.done():
                (dead if is_silent(answer.exception()) else alive).add(shard)
    for shard, future in futures.items():
        if shard in late and shard not in alive and not future.done():
            outcomes[shard] = late_error(where(shard), deadline_s)
            continue
        try:
            outcomes[shard] = future.result()
        except ReplayError as exc:
            outcomes[shard] = exc
    return outcomes


def late_error(where: str, deadline_s: float) -> UnavailableError:
    """The error of a *late* shard (``where`` names it): silent to its call and its probe."""
    return UnavailableError(f"{where} did not answer within the per-shard deadline "
                            f"(shard_deadline_s={deadline_s:g}), nor a probe within as long "
                            f"again: counted as down")


def _wait_all(futures: Iterable[Future], timeout_s: float) -> None:
    """Until every future is done or ``timeout_s`` has passed (``concurrent.futures.wait``'s
    ALL_COMPLETED, waiting on each future's own condition in turn: no waiter objects to
    build and tear down, which cost a one-shard call (an insert) more than its hop)."""
    end = time.monotonic() + timeout_s
    for future in futures:
        try:
            future.exception(timeout=max(0.0, end - time.monotonic()))
        except (FutureTimeout, CancelledError):
            pass  # not done in time (looked at by the caller), or cancelled (done)


def is_silent(error: BaseException | None) -> bool:
    """Whether a probe that ended with ``error`` found the server silent or gone (any other
    answer, an error included, came from a live server)."""
    return isinstance(error, (UnavailableError, DeadlineExceededError)) or (
        error is not None and not isinstance(error, ReplayError))
