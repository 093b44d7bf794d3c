"""The token check: calls without the token are refused before their request is read, and
each refusal is reported with its peer (the rapid-reset meter counts them per connection)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from replay_server.service.token_auth import TokenAuth


class Aborted(Exception):
    pass


class Context:
    """The parts of a ``grpc.aio.ServicerContext`` a refusal uses."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.status: tuple[grpc.StatusCode, str] | None = None

    def peer(self) -> str:
        return self._peer

    def cancelled(self) -> bool:
        return False

    async def abort(self, code, details, trailing_metadata=()):
        self.status = (code, details)
        raise Aborted


def intercepted(auth: TokenAuth, method: str, metadata: tuple) -> grpc.RpcMethodHandler:
    served = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

    async def continuation(details):
        return served

    details = SimpleNamespace(method=method, invocation_metadata=metadata)
    return asyncio.run(auth.intercept_service(continuation, details)), served


def test_a_call_without_the_token_is_refused_and_reported_with_its_peer() -> None:
    auth = TokenAuth("s3cret")
    reported: list[str] = []
    auth.on_refused = reported.append
    handler, served = intercepted(auth, "/replay.v1.ReplayService/Info",
                                  (("authorization", "Bearer wrong"),))
    assert handler is not served and handler.request_streaming  # the request is never read
    context = Context("ipv4:127.0.0.5:4242")
    with pytest.raises(Aborted):
        asyncio.run(handler.stream_unary(iter(()), context))
    assert context.status[0] == grpc.StatusCode.UNAUTHENTICATED
    assert reported == ["ipv4:127.0.0.5:4242"]


def test_a_call_with_the_token_or_a_health_check_is_served_and_not_reported() -> None:
    auth = TokenAuth("s3cret")
    reported: list[str] = []
    auth.on_refused = reported.append
    handler, served = intercepted(auth, "/replay.v1.ReplayService/Info",
                                  (("authorization", "Bearer s3cret"),))
    assert handler is served
    handler, served = intercepted(auth, "/grpc.health.v1.Health/Check", ())
    assert handler is served
    assert reported == []
