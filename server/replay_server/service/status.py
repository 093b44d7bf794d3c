"""The one place server errors become gRPC statuses.

Each expected error maps to a status code and an
:class:`~replay_proto.error_kinds.ErrorKind`, sent as the trailing metadata
``replay-error-kind`` so clients map errors to types without reading
messages. Anything else is a bug: logged with its traceback and answered
INTERNAL with a generic message. :func:`abort` is how every handler (and the
auth interceptor) ends a call with an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import grpc

from replay_proto.codec import CodecError
from replay_proto.error_kinds import ERROR_KIND_KEY, ErrorKind
from replay_server import errors
from replay_server.service.excerpt import STATUS_CHARS, excerpt
from replay_server.service.peer_log import PeerLog

log = logging.getLogger("replay_server.service")

CLIENT_LOG = PeerLog(log)
"""Where lines about a client's calls go: at most a few per client host per minute."""


class MessageTooLargeError(errors.InvalidArgumentError):
    """A unary response would exceed the message-size limit."""


class ShuttingDownError(Exception):
    """The server is draining (or still restoring at start); new work is refused."""


class UnauthenticatedError(Exception):
    """The call carries no token, or the wrong one."""


class RequestTimeoutError(Exception):
    """A call did not send a message the server waited for within ``server.request_timeout_s``
    (its first message, or a chunked request's next one): it was ended, its slot and memory
    freed (DEADLINE_EXCEEDED)."""


class _Refusal(Exception):
    """A limit's refusal. ``counted_by``, if set, is told when the refusal ends a call
    (:func:`abort`): a limit that refuses tries a call may still wait out (the memory
    budget) counts the calls it refused, not its tries."""

    counted_by: Callable[[], None] | None = None


class OverloadedError(_Refusal):
    """The server's call limits are reached *now* (memory budget, concurrent calls);
    the call was not run, so it may be tried again later."""


class LimitExceededError(_Refusal):
    """The call alone asks for more than a configured limit allows (a batch over
    max_batch_mb, more memory than the budget); it can never succeed as it is."""


# Most specific first: the first isinstance match wins.
_MAPPING: tuple[tuple[type[BaseException], grpc.StatusCode, ErrorKind], ...] = (
    (MessageTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.MESSAGE_TOO_LARGE),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.OVERLOADED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.LIMIT_EXCEEDED),
    (errors.InsufficientMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED,
     ErrorKind.LIMIT_EXCEEDED),
    (errors.LogFullError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.LIMIT_EXCEEDED),
    (errors.LogSpaceError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.LIMIT_EXCEEDED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE, ErrorKind.UNAVAILABLE),
    (RequestTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED, ErrorKind.DEADLINE_EXCEEDED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED, ErrorKind.UNAUTHENTICATED),
    (errors.SchemaMismatchError, grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.SCHEMA_MISMATCH),
    (errors.InvalidVariableError, grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.INVALID_VARIABLE),
    (errors.UnknownVariableError, grpc.StatusCode.NOT_FOUND, ErrorKind.UNKNOWN_VARIABLE),
    (errors.VariableBudgetError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.VARIABLE_BUDGET),
    (errors.InvalidPriorityError, grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.INVALID_PRIORITY),
    (errors.InvalidIdsError, grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.INVALID_IDS),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.INVALID_ARGUMENT),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.MALFORMED_REQUEST),
    (errors.UnknownTableError, grpc.StatusCode.NOT_FOUND, ErrorKind.UNKNOWN_TABLE),
    (errors.RateLimitedError, grpc.StatusCode.DEADLINE_EXCEEDED, ErrorKind.DEADLINE_EXCEEDED),
    (errors.CheckpointSpaceError, grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.CHECKPOINT_FAILED),
    (errors.CheckpointWriteError, grpc.StatusCode.FAILED_PRECONDITION,
     ErrorKind.CHECKPOINT_FAILED),
    (errors.CheckpointsDisabledError, grpc.StatusCode.FAILED_PRECONDITION,
     ErrorKind.NO_CHECKPOINT_DIR),
    (errors.EmptyTableError, grpc.StatusCode.FAILED_PRECONDITION, ErrorKind.EMPTY_TABLE),
    (errors.NoPrioritiesError, grpc.StatusCode.FAILED_PRECONDITION, ErrorKind.NO_PRIORITIES),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION,
     ErrorKind.FAILED_PRECONDITION),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, ErrorKind] | None:
    """``(code, kind)`` for an expected error, ``None`` for a bug."""
    for error, code, kind in _MAPPING:
        if isinstance(exc, error):
            return code, kind
    return None


_ROUTINE = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
"""Refusals that are part of normal operation (a rate limiter's wait ran out, draining)."""


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with ``exc``'s status and kind (a bug: logged, answered INTERNAL).

    A MemoryError (the process out of memory or address space) is answered
    RESOURCE_EXHAUSTED, kind ``overloaded``, never INTERNAL. The message is cut
    to :data:`~replay_server.service.excerpt.STATUS_CHARS`
    (an error listing a huge schema must still reach the client as its type).

    Refusals are logged per client, rate-limited (:mod:`~replay_server.service.peer_log`):
    a wrong token at WARNING, other client mistakes and limits at INFO, routine
    ones (a rate limiter's deadline, draining) at DEBUG; a bug with its traceback
    at ERROR, also rate-limited per client; a call the client already cancelled
    at DEBUG (its end is expected, whatever it raised).
    """
    peer = _peer(context)
    if isinstance(exc, _Refusal) and exc.counted_by is not None:
        exc.counted_by()
    if isinstance(exc, MemoryError):  # the machine, not a bug: the call may be tried again
        exc = OverloadedError(
            "the server ran out of memory serving this call (its address-space limit or the "
            "machine's memory); try again later, or send less at once")
    mapped = status_of(exc)
    if mapped is None:
        if _cancelled(context):
            log.debug("call from %s ended after the client cancelled it (%r)", peer, exc)
        else:
            CLIENT_LOG.log(peer, "internal", logging.ERROR,
                           "internal error while serving a request from %s", peer, exc_info=exc)
        code, kind, message = (grpc.StatusCode.INTERNAL, ErrorKind.INTERNAL,
                               "internal server error (the server logged the details)")
    else:
        (code, kind), message = mapped, excerpt(exc, STATUS_CHARS)
        level = (logging.WARNING if code == grpc.StatusCode.UNAUTHENTICATED
                 else logging.DEBUG if code in _ROUTINE else logging.INFO)
        CLIENT_LOG.log(peer, kind.value, level, "refused a call from %s: %s (%s): %s", peer,
                       code.name, kind.value, message)
    await context.abort(code, message, trailing_metadata=((ERROR_KIND_KEY, kind.value),))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def _peer(context: grpc.aio.ServicerContext) -> str:
    try:
        return context.peer() or "unknown"
    except Exception:  # a context that has no peer (a test double)
        return "unknown"


def _cancelled(context: grpc.aio.ServicerContext) -> bool:
    try:
        return bool(context.cancelled())
    except Exception:
        return False
