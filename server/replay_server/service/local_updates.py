"""Same-host waiting priority updates outside gRPC: a Unix socket beside the shared-memory rings.

A learner that waits for each update of 128 ids paid Python gRPC's round
trip on its call stream (0.36 ms on the 2-core machine with no replay work
at all), more than Reverb's whole C++ call (0.33 ms). On the server's host
the same request and answer travel over a Unix socket instead (a round trip
of about 0.06 ms there): a client's update call stream asks for a channel
(``local_channel``, with its host's boot id); the server answers with the
socket's path and a fresh 16-byte token; the client connects and sends the
token first. From then on each frame is a little-endian ``uint32`` length
and a CallStreamRequest carrying ``update_priorities``, answered by a frame
holding its CallStreamResponse, handled exactly as on the call stream (on
the event loop when small and the table is free, else in the engine pool;
typed errors in-band; counted as ``UpdatePriorities``).

Bounds and trust: the socket is created in the shared-memory directory with
mode 0600 and a name that follows the rings' pattern, with ``.sock`` (a dead
server's is swept at the next start); nothing is read from a connection beyond its
first 16 bytes unless they are a token handed out over an admitted,
authenticated call stream, and a connection that has not sent one within
:data:`TOKEN_WAIT_S` is closed, so a peer without a token costs the server
nothing. A token is single-use and belongs to one call stream: each stream
has at most one channel (a new ``local_channel`` replaces it), which ends
with the stream, so channels are bounded by the call streams' cap. One
request per connection is handled at a time (reading pauses meanwhile), a
frame over the stream's declared message size, or one that is not an
update, closes the connection, and the server's drain closes every channel
(clients fall back to their call stream).

Thread-safety: event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

from replay_feed.shared_ring import host_id, shm_dir
from replay_proto import messages
from replay_proto.codec import CodecError
from replay_proto.v1 import replay_pb2 as pb
from replay_server.errors import FailedPreconditionError

log = logging.getLogger("replay_server")

TOKEN_BYTES = 16
TOKEN_WAIT_S = 2.0
"""A connection that has not sent a valid token within this long is closed."""

_LENGTH = struct.Struct("<I")

Handle = Callable[[pb.CallStreamRequest],
                 "pb.CallStreamResponse | Awaitable[pb.CallStreamResponse]"]
"""Answers one update request as the call stream would (errors in-band): at once, or the
answer to await (the pool, a log record)."""


class LocalUpdates:
    """The server's socket for same-host updates (see the module docstring).

    Args:
        enabled: the server offers shared memory (``server.shared_memory``): the same
            promise of a same-host path, turned off by the same setting.
        max_message: the largest frame accepted (a call stream's declared message size).
    """

    def __init__(self, enabled: bool, max_message: int) -> None:
        self._enabled = enabled
        self._max_message = max_message
        self._path: Path | None = None
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future[None] | None = None
        self._tokens: dict[bytes, LocalChannel] = {}
        self._closed = False
        self._failed = "the server is shutting down"  # why there is no socket, if none

    async def offer(self, channel: LocalChannel,
                    request: pb.LocalChannelRequest) -> pb.LocalChannelOffer:
        """A token for ``channel`` (its call stream's), and where to connect.

        Raises:
            FailedPreconditionError: shared memory is off, the client is on another host, or
                the server is draining.
        """
        if not self._enabled:
            raise FailedPreconditionError("the server has shared_memory = false: no local "
                                          "channel for updates")
        if request.host_id != host_id():
            raise FailedPreconditionError("the client runs on another host: no local channel "
                                          "for updates")
        await self._start()
        if self._closed or self._path is None:
            raise FailedPreconditionError(f"no local channel for updates: {self._failed}")
        token = secrets.token_bytes(TOKEN_BYTES)
        channel.replace(token, self._tokens)
        return pb.LocalChannelOffer(path=str(self._path), token=token)

    async def _start(self) -> None:
        if self._server is not None or self._closed:
            return
        if self._starting is not None:
            await asyncio.shield(self._starting)
            return
        loop = asyncio.get_running_loop()
        self._starting = loop.create_future()
        path = shm_dir() / f"replay-{os.getpid()}-{secrets.token_hex(8)}.sock"
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), str(path))
            self._path = path
            # This user's processes only (not umask: it is the process's, and engine threads
            # write checkpoints meanwhile); before the chmod, a peer still needs a token.
            os.chmod(path, 0o600)
        except OSError as exc:  # no such directory, a path too long for a socket, ...
            self._failed = f"cannot listen at {path}: {exc}"
            log.warning("no local channel for same-host updates (%s); they use call streams",
                        self._failed)
            self.close()
        finally:
            self._starting.set_result(None)
        if self._closed:  # the drain began while the socket was made
            self.close()

    def claim(self, token: bytes) -> LocalChannel | None:
        """The channel ``token`` was handed out for (the token is used up), or ``None``."""
        channel = self._tokens.pop(token, None)
        if channel is not None:
            channel.token = None
        return channel

    @property
    def max_message(self) -> int:
        return self._max_message

    def close(self) -> None:
        """The server drains: no new channel; the socket's name goes, and every channel with
        its stream (each stream's channel is closed with it)."""
        self._closed = True
        for channel in list(self._tokens.values()):
            channel.close()
        self._tokens.clear()
        if self._server is not None:
            self._server.close()
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass


class LocalChannel:
    """One call stream's local channel: its outstanding token or its connection.

    Args:
        handle: answers one update request (the stream's own handling).
    """

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.token: bytes | None = None
        self._tokens: dict[bytes, LocalChannel] | None = None
        self.connection: _Connection | None = None
        self.closed = False

    def replace(self, token: bytes, tokens: dict[bytes, LocalChannel]) -> None:
        """A new token for this stream: the old token and connection end."""
        self._drop()
        self.token, self._tokens = token, tokens
        tokens[token] = self

    def close(self) -> None:
        """The stream ended: its token and connection end with it. Idempotent."""
        self.closed = True
        self._drop()

    def _drop(self) -> None:
        if self.token is not None and self._tokens is not None:
            self._tokens.pop(self.token, None)
        self.token = None
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()


class _Connection(asyncio.Protocol):
    """One client's socket: its token first, then update frames one at a time."""

    def __init__(self, owner: LocalUpdates) -> None:
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._channel: LocalChannel | None = None
        self._busy = False
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._deadline = asyncio.get_running_loop().call_later(TOKEN_WAIT_S, self._no_token)

    def _no_token(self) -> None:
        if self._channel is None:
            self.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._channel is None:
            if len(self._buffer) < TOKEN_BYTES:
                return
            channel = self._owner.claim(bytes(self._buffer[:TOKEN_BYTES]))
            if channel is None or channel.closed:
                self.close()  # not a token this server handed out: nothing more is read
                return
            del self._buffer[:TOKEN_BYTES]
            if self._deadline is not None:
                self._deadline.cancel()
            channel.connection = self
            self._channel = channel
        self._next()

    def _next(self) -> None:
        """Handle the next whole frame, if one is in and none is being handled."""
        if self._busy or self._transport is None or len(self._buffer) < _LENGTH.size:
            return
        (length,) = _LENGTH.unpack_from(self._buffer)
        if length > self._owner.max_message:
            log.info("closed a local update channel: a frame of %d bytes (at most %d)",
                     length, self._owner.max_message)
            self.close()
            return
        if len(self._buffer) < _LENGTH.size + length:
            return
        raw = bytes(self._buffer[_LENGTH.size:_LENGTH.size + length])
        del self._buffer[:_LENGTH.size + length]
        try:
            request = messages.decode_call_request(raw)
        except CodecError as exc:
            log.info("closed a local update channel: %s", exc)
            self.close()
            return
        if request.WhichOneof("call") != "update_priorities":
            log.info("closed a local update channel: it carries priority updates only")
            self.close()
            return
        channel = self._channel
        assert channel is not None
        try:
            answer = channel.handle(request)
        except Exception as exc:  # the handler answers errors in-band; anything else ends it
            log.error("local update channel failed", exc_info=exc)
            self.close()
            return
        if isinstance(answer, pb.CallStreamResponse):  # applied on the loop: answered now
            self._write(answer)
            self._next()
            return
        self._busy = True
        self._transport.pause_reading()  # one request at a time: bounded memory
        asyncio.ensure_future(self._answer(answer))

    async def _answer(self, pending: Awaitable[pb.CallStreamResponse]) -> None:
        try:
            answer = await pending
        except Exception as exc:  # the handler answers errors in-band; anything else ends it
            log.error("local update channel failed", exc_info=exc)
            self.close()
            return
        self._busy = False
        if self._write(answer):
            assert self._transport is not None
            self._transport.resume_reading()
            self._next()

    def _write(self, answer: pb.CallStreamResponse) -> bool:
        """Send ``answer``; ``False`` if the connection is gone."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        raw = answer.SerializeToString()
        transport.write(_LENGTH.pack(len(raw)) + raw)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._deadline is not None:
            self._deadline.cancel()
        channel, self._channel = self._channel, None
        if channel is not None and channel.connection is self:
            channel.connection = None

    def close(self) -> None:
        transport = self._transport
        if transport is not None:
            transport.close()
