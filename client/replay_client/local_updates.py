"""Waiting priority updates to a server on this host over a Unix socket instead of gRPC.

Python gRPC's round trip on an open stream (about 0.36 ms on the 2-core
machine) was more than Reverb's whole C++ update; over a Unix socket the
same request and answer take about 0.06 ms. The client's update call stream
(:mod:`replay_client.call_stream`) asks the server for a channel
(``local_channel``: the server checks the client's boot id and hands out the
socket's path and a single-use token, ``replay.proto``); this module holds
the connection and sends each waiting update over it as one frame (a
little-endian ``uint32`` length and the CallStreamRequest), reading one
frame back. The request and its answer are the call stream's, so errors stay
typed and the server counts it as ``UpdatePriorities``.

One update at a time goes over the socket; an update from another thread
meanwhile takes the call stream (no waiting on each other). Where the
channel cannot be had or breaks (another host, ``shared_memory = false``,
``REPLAY_SHARED_MEMORY=0``, a server from before channels, the stream ended,
the server draining) the update goes on the call stream as before: a
priority update applied twice changes nothing, so a broken channel is never
in doubt. A late answer raises
:class:`~replay_client.errors.DeadlineExceededError`, as on the stream, and
the connection is dropped (its answer might still come).

Thread-safety: :meth:`LocalUpdates.send` may be called from any thread.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from replay_client.errors import DeadlineExceededError
from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb

log = logging.getLogger("replay_client.call_stream")

_LENGTH = struct.Struct("<I")

MAX_ANSWER_BYTES = 1 << 20
"""An update's answer is a few bytes; a frame larger than this means the channel is broken."""

Ask = Callable[[], "pb.LocalChannelOffer | None"]
"""Asks the server for a channel on the current call stream (``None``: none to be had now)."""


class LocalUpdates:
    """The client's end of the local update channel (see the module docstring).

    Args:
        ask: asks for a channel (the call stream's ``local_channel`` request).
        touch: called on each update sent here (the call stream is in use: not idle).
        address: the server's address (for error messages).
    """

    def __init__(self, ask: Ask, touch: Callable[[], None], address: str) -> None:
        self._ask = ask
        self._touch = touch
        self._address = address
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None

    def send(self, request: bytes, timeout: float | None) -> pb.CallStreamResponse | None:
        """Send one encoded UpdatePrioritiesRequest over the channel and return its answer;
        ``None`` when it did not go this way (send it on the call stream).

        Raises:
            DeadlineExceededError: no answer within ``timeout`` seconds.
        """
        if not self._lock.acquire(blocking=False):
            return None  # another thread's update is on the socket
        try:
            sock = self._socket if self._socket is not None else self._connect()
            if sock is None:
                return None
            self._touch()
            frame = messages.encode_call_request(0, "update_priorities", request, timeout)
            try:
                sock.settimeout(timeout)
                sock.sendall(_LENGTH.pack(len(frame)) + frame)
                raw = _read_frame(sock)
                return pb.CallStreamResponse.FromString(raw)
            except TimeoutError:
                self._drop()
                raise DeadlineExceededError(
                    f"call to replay server at {self._address} timed out: no answer to "
                    f"update_priorities within {timeout} s") from None
            except Exception as exc:  # broken or closed (the stream ended, the server drained)
                log.debug("local update channel to %s ended (%r); updates take the call "
                          "stream", self._address, exc)
                self._drop()
                return None
        finally:
            self._lock.release()

    def _connect(self) -> socket.socket | None:
        offer = self._ask()
        if offer is None:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(offer.path)
            sock.sendall(offer.token)
        except OSError as exc:
            sock.close()
            log.info("cannot connect to the local update channel at %s (%s); updates take "
                     "the call stream", offer.path, exc)
            return None
        self._socket = sock
        return sock

    def _drop(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the connection (the next update asks again). Never waits for an update in
        flight: its socket is shut down, and that update takes the call stream."""
        sock = self._socket
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()


def _read_frame(sock: socket.socket) -> bytes:
    header = _read_exactly(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(header)
    if length > MAX_ANSWER_BYTES:
        raise ConnectionError(f"an answer frame of {length} bytes")
    return _read_exactly(sock, length)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("the server closed the local update channel")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)
