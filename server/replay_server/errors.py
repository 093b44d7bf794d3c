"""The engine's typed errors: every expected failure has its own class.

Each class stands for one kind of failure a caller can act on; the service
maps classes (never message text) to gRPC status codes in one place. Anything
that is not a :class:`ReplayServerError` is a bug.

Every error raised by a table method leaves the table exactly as it was.
"""

from __future__ import annotations


class ReplayServerError(Exception):
    """Base class of all expected engine failures."""


class InvalidArgumentError(ReplayServerError):
    """The request itself is wrong; retrying it unchanged cannot succeed."""


class SchemaMismatchError(InvalidArgumentError):
    """Inserted columns do not match the table's schema (keys, dtypes or shapes)."""


class InvalidPriorityError(InvalidArgumentError):
    """Priorities are not finite and >= 0, or do not match the ids/rows given."""


class InvalidIdsError(InvalidArgumentError):
    """Ids have the wrong dtype or shape, or were never issued by the table."""


class ConfigError(InvalidArgumentError):
    """A configuration value is invalid, or contradicts a checkpoint."""


class UnknownTableError(ReplayServerError):
    """No table has the requested name."""


class FailedPreconditionError(ReplayServerError):
    """The request is valid, but the table's state does not allow it now."""


class EmptyTableError(FailedPreconditionError):
    """Nothing in the table can be sampled yet."""


class NoPrioritiesError(FailedPreconditionError):
    """The table's sampler does not use priorities."""


class RateLimitedError(ReplayServerError):
    """The table's rate limiter (or ``max_times_sampled``) does not allow the call *now*.

    Nothing was changed. The call may succeed once other calls have changed the
    table (inserts unblock samples and the other way round). In-process
    callers get this at once; the service waits for such a change instead,
    holding no thread, until the call's deadline (see
    :mod:`replay_server.service.waiting`).

    Attributes:
        table: the table's name.
        operation: ``"insert"`` or ``"sample"``.
        count: rows the call asked to insert or sample (as the limiter counts them).
    """

    def __init__(self, message: str, *, table: str, operation: str, count: int) -> None:
        super().__init__(message)
        self.table = table
        self.operation = operation
        self.count = count


class InsufficientMemoryError(ReplayServerError):
    """A table would need more memory than the server may give it (its capacity times
    its row size, plus sampler state), or the allocation itself failed. Nothing was
    allocated or stored."""


class TableSpaceError(InsufficientMemoryError, ConfigError):
    """At start, a table cannot have the memory (or, ``memmap``, the disk space) its config
    asks for: the machine's shortage, named as such rather than as a mistake in the config
    (still a ConfigError, for callers that catch those)."""


class RestoreError(ConfigError):
    """Checkpoints exist but none could be restored, or loading one failed for a reason
    other than damage (out of memory, a bug): the server does not start, so that no
    checkpoint is thrown away (the message names each one and why)."""


class MalformedStateError(ConfigError):
    """A saved state (state dict or checkpoint) is malformed, not just contradicting the config."""


class CheckpointsDisabledError(FailedPreconditionError):
    """A checkpoint was requested but the server has no ``checkpoint_dir``."""


class CheckpointWriteError(ReplayServerError):
    """Writing a checkpoint failed (the checkpoint directory is unwritable, a file failed, ...).

    Nothing of the failed checkpoint remains; the tables are unaffected.
    """


class CheckpointPartError(CheckpointWriteError):
    """A checkpoint was written without some of its parts (a table or the named variables,
    whose state could not be saved); every other part was written. The message names the
    checkpoint and each missing part."""


class CheckpointSpaceError(CheckpointWriteError):
    """Writing a checkpoint failed for lack of space (disk full, quota, file size limit)."""


class InvalidVariableError(InvalidArgumentError):
    """A published variable is malformed: bad name, no tensors, an empty key, a bad dtype."""


class UnknownVariableError(ReplayServerError):
    """No variable has been published under the requested name."""


class VariableBudgetError(ReplayServerError):
    """Storing a variable would exceed the server's budget for variables (nothing changed)."""


class LogFullError(ReplayServerError):
    """A change was refused because the write-ahead log is at ``server.wal_max_mb`` and a
    checkpoint could not truncate it; nothing of the change was stored."""


class LogWriteError(FailedPreconditionError):
    """The write-ahead log cannot be written (a write failed, the disk is full); changes are
    refused, or were not acknowledged, until a checkpoint succeeds."""


class LogSpaceError(LogWriteError):
    """The write-ahead log's disk has no room for a change (disk full, quota, file size
    limit): refused before it was applied (nothing stored), or, when its write failed, not
    acknowledged. The message names the log's directory."""


class CorruptLogError(RestoreError):
    """The write-ahead log cannot be replayed (a segment missing, from another server or
    incarnation, damaged in the middle); the server does not start. The message names the
    segment and offset."""
