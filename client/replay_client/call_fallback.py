"""When a call stream's request goes as a plain call instead, and what the plain call raises.

A request that could not go on a client's call stream
(:mod:`replay_client.call_stream`) raises :class:`StreamFallback`; the
caller then makes the plain call through :func:`unary_after`. Which ways a
stream can end leave its request unapplied (so the plain call is safe) is
:data:`NOT_HANDLED` and :func:`drained`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from replay_client.errors import ReplayError, UnavailableError, from_status
from replay_proto.error_kinds import ERROR_KIND_KEY, ErrorKind
from replay_proto.v1 import replay_pb2 as pb

T = TypeVar("T")

NOT_HANDLED = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                          grpc.StatusCode.PERMISSION_DENIED})
"""How a server ends a stream before it handles the request in hand (an unknown RPC, a
refusal at admission or by the token check, a message it could not take): nothing of it
was applied, and the request goes unary (which raises the refusal's own error if it
stands). The same holds for a draining server's end (:func:`drained`) and a connection
gRPC never made (:func:`~replay_client.connection.never_sent`)."""


def drained(exc: grpc.RpcError) -> bool:
    """Whether the server ended the stream because it is draining: it answers the request in
    its hands first, so the stream ends with none in doubt (an UNAVAILABLE of the network
    carries no error kind)."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    metadata = dict(exc.trailing_metadata() or ())
    return metadata.get(ERROR_KIND_KEY) == ErrorKind.UNAVAILABLE.value


class StreamFallback(Exception):
    """This request did not go on the stream (nothing of it was applied): make the unary call
    (:func:`unary_after`).

    Attributes:
        error: the server's own refusal when it answered the request UNAVAILABLE (draining,
            restoring), else ``None``.
    """

    def __init__(self, message: str, error: ReplayError | None = None) -> None:
        super().__init__(message)
        self.error = error


def unary_after(fallback: StreamFallback, call: Callable[[], T]) -> T:
    """``call()``, the unary call a request that fell back makes; if the server had refused
    the request itself as unavailable and the unary call finds it unavailable too (it went
    away while draining), the server's own words are raised, as the unary call alone would
    have raised them."""
    try:
        return call()
    except UnavailableError:
        if fallback.error is not None:
            raise fallback.error from None
        raise


def call_error(error: pb.CallError, address: str) -> BaseException:
    """The typed error of one request a call stream's server refused (UNAVAILABLE: a
    :class:`StreamFallback` carrying it: go unary, which retries)."""
    try:
        kind: ErrorKind | None = ErrorKind(error.kind)
    except ValueError:
        kind = None
    code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN)
    typed: ReplayError = from_status(code, kind, error.message, address)
    if isinstance(typed, UnavailableError):
        return StreamFallback(str(typed), typed)
    return typed
