"""``Connection``: one gRPC channel to one server, and how a unary call is made and retried.

What every part of the client needs to talk to a server (the address, the
token, TLS, the message limit, the call timeout and the retry window) lives here;
``ReplayClient``, the learner's network stream and the priority updater
each hold the connection, never the whole client.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import grpc

from replay_feed.backoff import Backoff
from replay_client.errors import (
    InvalidArgumentError,
    OverloadedError,
    ReplayError,
    UnauthenticatedError,
    UnavailableError,
    from_rpc_error,
)
from replay_client.tls import TlsConfig, check_token_channel
from replay_proto.addresses import AddressError, check_address
from replay_proto.call_metadata import request_bytes_metadata
from replay_proto.error_kinds import kind_of

SERVICE_PATH = "/replay.v1.ReplayService/"
CONNECT_TIMEOUT_S = 1.0
"""How long calls retry a server that has never answered this connection (nothing listens
at its address, say) before raising "no replay server at HOST:PORT (is it running?)"."""
KEEPALIVE_S = 60.0
"""While a call is open the channel pings the server (HTTP/2 PING) every this many seconds,
so that a call to a server that vanished without closing the connection (power loss,
partition) fails (UNAVAILABLE, then the usual retry) instead of waiting for TCP to give
up. Servers accept pings every 10 s at most often (``server.keepalive_s`` if shorter:
``replay_server.service.limits.client_ping_floor_s``); faster ones would get the
connection closed (GOAWAY ``too_many_pings``)."""
KEEPALIVE_TIMEOUT_S = 20.0
"""How long a ping may go unanswered before the channel drops the connection."""
RECONNECT_BACKOFF_MAX_S = 2.0
"""The longest gRPC waits between two attempts to reconnect to a server (its own default is
120 s, reached after a few minutes down): a client reaches a server that came back within
this, not minutes later, when its calls' retries (``max_retry_s``) have long given up.
Measured: 60 s down, reachable 8.1 s after the server came back with gRPC's default, 1.0 s
with this one. An attempt is one TCP connect, made only while calls are waiting."""
class _ClientTimeout:
    """The type of :data:`CLIENT_TIMEOUT`: one instance, which pickles as itself (a plain
    ``object()`` came back from pickle as another object, taken for a timeout value)."""

    def __repr__(self) -> str:
        return "CLIENT_TIMEOUT"

    def __reduce__(self) -> str:
        return "CLIENT_TIMEOUT"


CLIENT_TIMEOUT: Any = _ClientTimeout()
"""``timeout`` default of :meth:`Connection.unary`: the connection's own timeout."""


class Connection:
    """A lazily opened channel to one replay server.

    Safe to share between threads. After ``fork()`` the child opens its own
    channel on first use (gRPC channels do not survive a fork). Pickles as
    its settings.

    Args:
        address: ``host:port`` of the server (``host`` alone: port 50051).
        timeout: seconds each call may take, retries included (``None``: no limit).
        token: auth token, sent as ``authorization: Bearer <token>``.
        max_message_mb: the message-size limit (match the server's).
        max_retry_s: longest total time spent retrying an unavailable server.
        tls: TLS settings (``None``: a plaintext channel).
        allow_plaintext_token: send ``token`` over plaintext to a non-loopback address.
        connect_timeout_s: until the server first answers, retrying it stops after
            this long (at most ``max_retry_s``) with "no replay server at ..."; a
            server that answered once and went away is retried for ``max_retry_s``.

    Raises:
        InvalidArgumentError: a malformed address (empty, a port that is no number
            from 1 to 65535: :func:`replay_proto.addresses.check_address`), or a
            token would cross a network in clear text
            (:func:`~replay_client.tls.check_token_channel`).
    """

    def __init__(self, address: str, *, timeout: float | None, token: str | None,
                 max_message_mb: int, max_retry_s: float, tls: TlsConfig | None = None,
                 allow_plaintext_token: bool = False,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        try:
            address = check_address(address)  # "localhost": port 50051, never gRPC's 443
        except AddressError as exc:
            raise InvalidArgumentError(str(exc)) from None
        check_token_channel(address, token, tls, allow_plaintext_token)
        self.address = address
        self.timeout = timeout
        self.token = token
        self.max_message_mb = max_message_mb
        self.max_retry_s = max_retry_s
        self.tls = tls
        self.allow_plaintext_token = allow_plaintext_token
        self.connect_timeout_s = connect_timeout_s
        self.answered = False
        """Whether the server has answered a call of this connection (set once, never reset)."""
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        self._channel: grpc.Channel | None = None
        self._calls: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._refusal: str | None = None  # set by cancel: why every later call is refused

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "timeout": self.timeout, "token": self.token,
                "max_message_mb": self.max_message_mb, "max_retry_s": self.max_retry_s,
                "tls": self.tls, "allow_plaintext_token": self.allow_plaintext_token,
                "connect_timeout_s": self.connect_timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("address"), **state)  # type: ignore[misc]

    def method(self, name: str, kind: str = "unary_unary") -> Any:
        """The callable of RPC ``name`` (``kind``: ``unary_unary``, ``stream_stream``,
        ``stream_unary`` or ``unary_stream``)."""
        call = self._calls.get(name)
        if call is not None and self._pid == os.getpid():
            return call
        with self._lock:
            if self._refusal is not None:
                raise UnavailableError(self._refusal)
            if self._pid != os.getpid():  # a forked child: open its own channel
                self._channel, self._calls, self._pid = None, {}, os.getpid()
            if self._channel is None:
                size = self.max_message_bytes
                options = [("grpc.max_receive_message_length", size),
                           ("grpc.max_send_message_length", size),
                           ("grpc.max_reconnect_backoff_ms", int(RECONNECT_BACKOFF_MAX_S * 1000)),
                           *keepalive_options()]
                if self.tls is None:
                    self._channel = grpc.insecure_channel(self.address, options=options)
                else:
                    self._channel = grpc.secure_channel(
                        self.address, self.tls.credentials(),
                        options=options + self.tls.channel_options())
            if name not in self._calls:
                self._calls[name] = getattr(self._channel, kind)(SERVICE_PATH + name)
            return self._calls[name]

    def unary(self, name: str, request: Any, *, retry: bool,
              timeout: Any = CLIENT_TIMEOUT, kind: str = "unary_unary",
              retry_unsent: bool = True) -> Any:
        """Call RPC ``name`` with raw ``request`` bytes; return the raw answer.

        ``kind`` ``"stream_unary"``: ``request`` is a list of messages (a chunked
        request, :mod:`replay_client.chunked`), declared as its largest;
        ``"unary_stream"``: the answer is the list of messages received.

        Retries (``retry``: the call is safe to repeat) while the server is
        UNAVAILABLE; whatever ``retry`` says, a call gRPC could not send
        (:func:`never_sent`: it reached no server; unless ``retry_unsent`` is
        False, for a look that must fail fast) and a call the server refused
        as overloaded (it ran nothing of it); on the
        :class:`~replay_client.backoff.Backoff` schedule, within the call's
        timeout and ``max_retry_s`` (see :meth:`retry_window`). Sends the
        request's size (``replay_proto.call_metadata``) so the server reserves
        just that much memory before reading it.

        Raises:
            ReplayError: the typed error of the failure (see ``replay_client.errors``).
        """
        timeout = self.timeout if timeout is CLIENT_TIMEOUT else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        size = max(map(len, request)) if kind == "stream_unary" else len(request)
        metadata = self.metadata + request_bytes_metadata(size)
        backoff: Backoff | None = None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                sent = iter(request) if kind == "stream_unary" else request
                answer = self.method(name, kind)(sent, timeout=remaining, metadata=metadata)
                answer = list(answer) if kind == "unary_stream" else answer
                self.answered = True
                return answer
            except grpc.RpcError as exc:
                error = self.error(exc)
                unsent = retry_unsent and never_sent(exc)
            # An overloaded server ran nothing of the call, and a call gRPC could not send
            # reached none: even an insert may be repeated then.
            if not isinstance(error, OverloadedError) and not (
                (retry or unsent) and isinstance(error, UnavailableError)
            ):
                raise error from None
            backoff = backoff or Backoff(self.retry_window(), deadline=deadline)
            delay = backoff.next_delay()
            if delay is None:
                raise error from None
            time.sleep(delay)

    def error(self, exc: grpc.RpcError) -> ReplayError:
        """The typed error of a failed call. UNAVAILABLE from a server that never answered
        this connection says there may be no server at the address."""
        trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        if kind_of(trailing) is not None:
            self.answered = True  # the server itself refused the call
        error = from_rpc_error(exc, self.address)
        if isinstance(error, UnavailableError) and not self.answered:
            details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
            return UnavailableError(f"{self._unreached(details)}: {details}")
        if isinstance(error, UnauthenticatedError):
            return UnauthenticatedError(f"{error}; {self._token_hint()}")
        return error

    def _unreached(self, details: str) -> str:
        """Why no server answered: nothing listens, or (something accepts a connection) the
        TLS settings of the two sides differ, said with the setting that fixes it."""
        if "handshake" in details.lower() or "SSL" in details:
            return (f"the TLS handshake with {self.address} failed (its certificate does not "
                    f"chain to the CA this client trusts, or names another host: "
                    f"TlsConfig.from_files(ca=...), server_name=...; or the server speaks "
                    f"plaintext: no tls=)")
        if not _accepts_connections(self.address, self.connect_timeout_s):
            return f"no replay server at {self.address} (is it running?)"
        if self.tls is None:
            return (f"something at {self.address} closes this client's plaintext connections: "
                    f"if the server uses TLS (its tls_cert_file), connect with "
                    f"tls=TlsConfig.from_files(ca=...) (CLI: --tls-ca FILE)")
        if self.tls.certificate_chain is None:
            return (f"the server at {self.address} closed the TLS connection: if it requires "
                    f"client certificates (mutual TLS: its tls_client_ca_file), pass "
                    f"TlsConfig.from_files(ca=..., cert=..., key=...) (CLI: --tls-cert, "
                    f"--tls-key)")
        return f"the server at {self.address} closed the connection before answering"

    def _token_hint(self) -> str:
        """What to set when the server refused this client's token."""
        if not self.token:
            return ("this client sent no token: set REPLAY_TOKEN in its environment to the "
                    "server's token (the variable the server's auth_token_env names), or pass "
                    "ReplayClient(..., token=...) (CLI: --token-env NAME)")
        return ("the token this client sent is not the server's: compare REPLAY_TOKEN (or "
                "token=...) with the variable the server's auth_token_env names")

    def retry_window(self) -> float:
        """Seconds to retry an unavailable server: ``max_retry_s``, but only
        ``connect_timeout_s`` while no server has answered and nothing accepts a
        TCP connection at the address (gRPC may report a refusal it saw earlier,
        through a connection another client in this process shares, so the
        address is asked directly)."""
        if self.answered or _accepts_connections(self.address, self.connect_timeout_s):
            return self.max_retry_s
        return min(self.max_retry_s, self.connect_timeout_s)

    def cancel(self, reason: str) -> None:
        """Give this connection up: close its channel, which ends every call in flight on it
        (each raises its typed error), and refuse every later call, retries of calls in
        flight included, with :class:`UnavailableError` saying ``reason``. For a connection
        that only some calls use (a sharded client's inline lane,
        :mod:`replay_client.sharded.lanes`); permanent, unlike :meth:`close`."""
        with self._lock:
            self._refusal = reason
            if self._channel is not None:
                self._channel.close()
                self._channel, self._calls = None, {}

    def close(self) -> None:
        """Close the channel (a later call opens a new one)."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel, self._calls = None, {}


def never_sent(exc: grpc.RpcError) -> bool:
    """Whether a failed call was never sent: gRPC had no connection to send it on.

    UNAVAILABLE "failed to connect to all addresses" is gRPC's answer to a call
    made while its channel cannot connect (its last attempt failed, or the one
    it made for this call did): the call was refused in this process, before any
    byte of it left. Any other UNAVAILABLE (a connection lost during the call)
    may come after the server ran it.
    """
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or ""
    return code == grpc.StatusCode.UNAVAILABLE and details.startswith(
        "failed to connect to all addresses")


def _accepts_connections(address: str, timeout: float) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` now (an address of
    another form, ``unix:`` or ``dns:///`` say, is taken to: it gets the long window)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return True
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=max(timeout, 0.1)):
            return True
    except OSError:
        return False


def keepalive_options() -> list[tuple[str, int]]:
    """The channel's keepalive options (:data:`KEEPALIVE_S`): pings only while a call is open,
    also on a call that sends nothing for long (a stream waiting for data)."""
    return [("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),  # gRPC waits this
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0)]
