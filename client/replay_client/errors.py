"""The client's typed errors, and the one place gRPC failures become them.

Every failure a caller can act on has its own class under :class:`ReplayError`.
The server names the precise kind in the trailing metadata (see
:mod:`replay_proto.error_kinds`); the status code is the fallback. Messages
are for people: never match on them. Errors about the caller's own arguments
are also ``ValueError``s, timeouts ``TimeoutError``s and lost servers
``ConnectionError``s, so generic handlers catch them too.
"""

from __future__ import annotations

import builtins

import grpc

from replay_feed import stream as _feed_stream
from replay_proto.error_kinds import ErrorKind, kind_of


class ReplayError(Exception):
    """Base class of every error the client raises."""


class InvalidArgumentError(ReplayError, ValueError):
    """The request is wrong; retrying it unchanged cannot succeed."""


class SchemaMismatchError(InvalidArgumentError):
    """Inserted columns do not match the table's schema."""


class InvalidPriorityError(InvalidArgumentError):
    """A priority is negative, NaN or infinite, or shapes do not match."""


class InvalidIdsError(InvalidArgumentError):
    """Ids are not int64 or were never issued by the table."""


class MalformedRequestError(InvalidArgumentError):
    """The server could not decode the request (a client/server version mismatch?)."""


class UnknownTableError(ReplayError):
    """No table has that name."""


class FailedPreconditionError(ReplayError):
    """The table's state does not allow the call now."""


class EmptyTableError(FailedPreconditionError):
    """Nothing in the table can be sampled yet."""


class StreamEndedError(FailedPreconditionError, _feed_stream.StreamEndedError):
    """``stream.ack()`` after the stream ended holding a queue batch not finished: that
    batch went back to the queue, unacknowledged (ack before ``close()``, and within
    ``replay_feed.stream.LATE_ACK_S`` of leaving a ``for`` loop holding the batch)."""


class NoPrioritiesError(FailedPreconditionError):
    """The table's sampler does not use priorities."""


class NoCheckpointDirError(FailedPreconditionError):
    """A checkpoint was requested from a server that has no ``checkpoint_dir``."""


class CheckpointError(ReplayError):
    """The server could not write the checkpoint (disk full, directory unwritable, ...).

    Nothing of it was kept; the server goes on serving. The message says why.
    """


class MessageTooLargeError(ReplayError):
    """A request or response exceeds the message-size limit."""


class OverloadedError(ReplayError):
    """The server is at its call limits now (memory budget, concurrent calls).

    The call was not run, so retrying it later is safe, inserts included;
    the message names the limit.
    """


class LimitExceededError(ReplayError):
    """The call asks for more than a server limit ever allows (a batch over
    ``max_batch_mb``, a table's rows at its capacity beyond the server's
    memory); the message names the limit. Nothing was changed."""


class UnauthenticatedError(ReplayError):
    """The server wants a token (``ReplayClient(token=...)``) and got none or a wrong one."""


class DeadlineExceededError(ReplayError, builtins.TimeoutError):
    """The call did not finish within its timeout (e.g. a table's rate limiter held it back)."""


class UnavailableError(ReplayError, ConnectionError):
    """The server cannot be reached (down, restarting or shutting down)."""


class InternalError(ReplayError):
    """The server failed unexpectedly (a bug; its log has the details)."""


class PriorityUpdateError(ReplayError):
    """An ``update_priorities(..., wait=False)`` failed in the background; ``__cause__`` says why."""


class WriterError(ReplayError):
    """A background insert of a :class:`~replay_client.Writer` failed; ``__cause__`` says why."""


class InvalidVariableError(InvalidArgumentError):
    """A state dict cannot be published: not tensors only, empty, a bad name, key or dtype."""


class UnknownVariableError(ReplayError):
    """No variable has been published under that name (fetch with ``newer_than`` to wait)."""


class VariableBudgetError(ReplayError):
    """The server's budget for variables (``server.variables_max_mb``) would be exceeded."""


class ShardingError(InvalidArgumentError):
    """The shards do not form one logical replay: two servers report the same shard
    index, a table differs between shards, or an id belongs to no known shard."""


class UnsupportedError(ReplayError):
    """The call is not supported by this kind of client (e.g. a sharded one); the message says
    what to use instead."""


class EmptyBufferError(EmptyTableError, RuntimeError):
    """``RemoteReplayBuffer.sample`` found nothing to sample and was not asked to wait.

    TorchRL's buffers raise ``RuntimeError`` there, so this is one (and an
    :class:`EmptyTableError`): ``except RuntimeError`` in TorchRL code keeps working."""


class TableMismatchError(InvalidArgumentError):
    """A table cannot stand for the TorchRL storage or sampler a buffer was given; the
    message names the config line to change."""


class UnsupportedComponentError(InvalidArgumentError):
    """A TorchRL storage, sampler, writer or buffer option with no server counterpart; the
    message names what to use instead."""


_BY_KIND: dict[ErrorKind, type[ReplayError]] = {
    ErrorKind.SCHEMA_MISMATCH: SchemaMismatchError,
    ErrorKind.INVALID_PRIORITY: InvalidPriorityError,
    ErrorKind.INVALID_IDS: InvalidIdsError,
    ErrorKind.INVALID_ARGUMENT: InvalidArgumentError,
    ErrorKind.MALFORMED_REQUEST: MalformedRequestError,
    ErrorKind.UNKNOWN_TABLE: UnknownTableError,
    ErrorKind.EMPTY_TABLE: EmptyTableError,
    ErrorKind.NO_PRIORITIES: NoPrioritiesError,
    ErrorKind.FAILED_PRECONDITION: FailedPreconditionError,
    ErrorKind.NO_CHECKPOINT_DIR: NoCheckpointDirError,
    ErrorKind.CHECKPOINT_FAILED: CheckpointError,
    ErrorKind.MESSAGE_TOO_LARGE: MessageTooLargeError,
    ErrorKind.OVERLOADED: OverloadedError,
    ErrorKind.LIMIT_EXCEEDED: LimitExceededError,
    ErrorKind.UNAUTHENTICATED: UnauthenticatedError,
    ErrorKind.DEADLINE_EXCEEDED: DeadlineExceededError,
    ErrorKind.UNAVAILABLE: UnavailableError,
    ErrorKind.INTERNAL: InternalError,
    ErrorKind.INVALID_VARIABLE: InvalidVariableError,
    ErrorKind.UNKNOWN_VARIABLE: UnknownVariableError,
    ErrorKind.VARIABLE_BUDGET: VariableBudgetError,
}
assert set(_BY_KIND) == set(ErrorKind), "every error kind needs a client class"

_BY_CODE: dict[grpc.StatusCode, type[ReplayError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: UnknownTableError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLargeError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    # The client never cancels a call it still waits for: a CANCELLED status comes from
    # the server, which cancels calls not yet started when it shuts down.
    grpc.StatusCode.CANCELLED: UnavailableError,
}


def error_of(kind: ErrorKind, message: str) -> ReplayError:
    """The client's error of ``kind`` (a refusal checked on this side, before any call)."""
    return _BY_KIND[kind](message)


def from_rpc_error(exc: grpc.RpcError, address: str) -> ReplayError:
    """The typed error for a failed call to the server at ``address``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return from_status(code, kind_of(trailing), details, address)


def from_status(code: grpc.StatusCode, kind: ErrorKind | None, details: str,
                address: str) -> ReplayError:
    """The typed error for a status ``code`` with error ``kind`` (``None``: unknown)."""
    cls = _BY_KIND[kind] if kind is not None else _BY_CODE.get(code, InternalError)
    if cls is UnavailableError and code == grpc.StatusCode.CANCELLED:
        return cls(f"replay server at {address} cancelled the call (it is shutting down?): "
                   f"{details}")
    if cls is UnavailableError:
        return cls(f"replay server at {address} is unavailable: {details}")
    if cls is DeadlineExceededError:
        return cls(f"call to replay server at {address} timed out: {details}")
    return cls(details)
