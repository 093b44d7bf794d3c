"""The one place engine errors become gRPC statuses.

Each expected error maps to a status code and a machine-readable kind, sent
as the trailing metadata ``replay-error-kind`` so clients map errors to types
without reading messages. Anything else is a bug: logged with its traceback
and answered INTERNAL with a generic message.
"""

from __future__ import annotations

import grpc

from replay_proto.codec import CodecError
from replay_server import errors

ERROR_KIND_KEY = "replay-error-kind"


class MessageTooLargeError(errors.InvalidArgumentError):
    """A unary response would exceed the message-size limit."""


class ShuttingDownError(Exception):
    """The server is draining (or still restoring at start); new work is refused."""


# Most specific first: the first isinstance match wins.
_MAPPING: tuple[tuple[type[BaseException], grpc.StatusCode, str], ...] = (
    (MessageTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED, "message_too_large"),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE, "unavailable"),
    (errors.SchemaMismatchError, grpc.StatusCode.INVALID_ARGUMENT, "schema_mismatch"),
    (errors.InvalidPriorityError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_priority"),
    (errors.InvalidIdsError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_ids"),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT, "malformed_request"),
    (errors.UnknownTableError, grpc.StatusCode.NOT_FOUND, "unknown_table"),
    (errors.RateLimitedError, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded"),
    (errors.CheckpointSpaceError, grpc.StatusCode.RESOURCE_EXHAUSTED, "checkpoint_failed"),
    (errors.CheckpointWriteError, grpc.StatusCode.FAILED_PRECONDITION, "checkpoint_failed"),
    (errors.CheckpointsDisabledError, grpc.StatusCode.FAILED_PRECONDITION, "no_checkpoint_dir"),
    (errors.EmptyTableError, grpc.StatusCode.FAILED_PRECONDITION, "empty_table"),
    (errors.NoPrioritiesError, grpc.StatusCode.FAILED_PRECONDITION, "no_priorities"),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"),
)

EXPECTED = tuple(error for error, _, _ in _MAPPING)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """``(code, kind)`` for an expected error, ``None`` for a bug."""
    for error, code, kind in _MAPPING:
        if isinstance(exc, error):
            return code, kind
    return None
