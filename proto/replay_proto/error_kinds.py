"""The machine-readable kind of a refused call: one trailer key, one set of names.

The server answers every expected error with a gRPC status and names its
precise kind in the trailing metadata :data:`ERROR_KIND_KEY`; the client maps
kinds (never message text) to its exception classes. Both sides take the key
and the names from here, so each is spelled once.
"""

from __future__ import annotations

from enum import Enum

ERROR_KIND_KEY = "replay-error-kind"
"""Trailing-metadata key whose value is an :class:`ErrorKind` value."""


class ErrorKind(str, Enum):
    """Every kind of refusal the server reports (the value travels on the wire)."""

    SCHEMA_MISMATCH = "schema_mismatch"
    INVALID_PRIORITY = "invalid_priority"
    INVALID_IDS = "invalid_ids"
    INVALID_ARGUMENT = "invalid_argument"
    MALFORMED_REQUEST = "malformed_request"
    UNKNOWN_TABLE = "unknown_table"
    EMPTY_TABLE = "empty_table"
    NO_PRIORITIES = "no_priorities"
    FAILED_PRECONDITION = "failed_precondition"
    NO_CHECKPOINT_DIR = "no_checkpoint_dir"
    CHECKPOINT_FAILED = "checkpoint_failed"
    MESSAGE_TOO_LARGE = "message_too_large"
    OVERLOADED = "overloaded"
    LIMIT_EXCEEDED = "limit_exceeded"
    UNAUTHENTICATED = "unauthenticated"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    INVALID_VARIABLE = "invalid_variable"
    UNKNOWN_VARIABLE = "unknown_variable"
    VARIABLE_BUDGET = "variable_budget"


def kind_of(trailing_metadata: object) -> ErrorKind | None:
    """The kind named in a call's trailing metadata (None: absent or unknown to this version)."""
    for key, value in trailing_metadata or ():  # type: ignore[attr-defined]
        if key == ERROR_KIND_KEY:
            try:
                return ErrorKind(value)
            except ValueError:
                return None
    return None
