"""A bare HTTP/2 client for attack tests: connections from a chosen source address that finish
the handshake and then say nothing, or send one gRPC call and do not wait for its answer.

gRPC's own client can neither pick a source address nor hold a connection
without a call, which is exactly what an attacker does. The whole loopback
net (127.0.0.0/8) reaches a server on 127.0.0.1, so ``source="127.0.0.7"``
is another host as far as the server can tell. Requests use HPACK literals
without indexing (no Huffman, no dynamic table), which every server accepts.
"""

from __future__ import annotations

import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = (
    0x0, 0x1, 0x2, 0x3, 0x4, 0x6, 0x7, 0x8)
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """HPACK: each header a literal without indexing, new name, no Huffman."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _integer(len(name), 7) + name.encode()
        out += _integer(len(value), 7) + value.encode()
    return bytes(out)


class RawConnection:
    """One TCP connection to ``127.0.0.1:port`` from ``source``, speaking bare HTTP/2.

    Args:
        port: the server's port.
        source: the local address to connect from (any of 127.0.0.0/8).
        timeout: seconds for connecting and for each read.
        receive_buffer: the socket's receive buffer in bytes (``SO_RCVBUF``, set before
            connecting), for a client that reads nothing and must not absorb much.
    """

    def __init__(self, port: int, source: str = "127.0.0.1", timeout: float = 5.0,
                 receive_buffer: int | None = None) -> None:
        self.port = port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.bind((source, 0))
        self.sock.connect(("127.0.0.1", port))
        self._next_stream = 1
        self._buffer = b""

    def handshake(self) -> bool:
        """Send the preface and SETTINGS, read the server's SETTINGS and acknowledge them;
        whether the server answered (False: it closed the connection)."""
        try:
            self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
            while True:
                kind, flags, _, _ = self._read_frame()
                if kind == SETTINGS and not flags & ACK:
                    self.sock.sendall(frame(SETTINGS, ACK, 0))
                    return True
        except (OSError, ConnectionError, EOFError):
            return False

    def call(self, path: str, message: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """Send one gRPC call (its HEADERS and one DATA frame ending the stream); the answer
        is not read."""
        stream = self._next_stream
        self._next_stream += 2
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", f"127.0.0.1:{self.port}"), ("content-type", "application/grpc"),
                   ("te", "trailers"), *metadata]
        body = b"\x00" + struct.pack(">I", len(message)) + message
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, header_block(headers))
                          + frame(DATA, END_STREAM, stream, body))

    def send_first(self, path: str, message: bytes,
                   metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """Open one gRPC call and send its first message without ending the request (a
        streaming request that stalls there); the stream's id."""
        stream = self.open_call(path, metadata)
        body = b"\x00" + struct.pack(">I", len(message)) + message
        self.sock.sendall(frame(DATA, 0, stream, body))
        return stream

    def open_call(self, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """Open one gRPC call (its HEADERS) and never send its request; the stream's id."""
        stream = self._next_stream
        self._next_stream += 2
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", f"127.0.0.1:{self.port}"), ("content-type", "application/grpc"),
                   ("te", "trailers"), *metadata]
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, header_block(headers)))
        return stream

    def ended_streams(self, seconds: float) -> set[int]:
        """Streams the server ended (its trailers: HEADERS with END_STREAM, or RST_STREAM),
        read for up to ``seconds``, answering the server's pings meanwhile."""
        ended: set[int] = set()
        timeout = self.sock.gettimeout()
        deadline = time.monotonic() + seconds
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                kind, flags, stream, payload = self._read_frame()
                if kind == PING and not flags & ACK:
                    self.sock.sendall(frame(PING, ACK, 0, payload))
                if (kind == HEADERS and flags & END_STREAM) or kind == RST_STREAM:
                    ended.add(stream)
        except (OSError, ConnectionError, EOFError):
            pass
        finally:
            self.sock.settimeout(timeout)
        return ended

    def answered(self) -> bool:
        """Wait for the server's answer to the last call (its first HEADERS); False if the
        connection ended first."""
        stream = self._next_stream - 2
        try:
            while True:
                kind, flags, got, payload = self._read_frame()
                if kind == PING and not flags & ACK:
                    self.sock.sendall(frame(PING, ACK, 0, payload))
                if kind == HEADERS and got == stream:
                    return True
        except (OSError, ConnectionError, EOFError):
            return False

    def closed_by_server(self) -> bool:
        """Whether the server has closed the connection (or sent GOAWAY), without waiting."""
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
                self._buffer += data
                if self._goaway_seen():
                    return True
        except BlockingIOError:
            return self._goaway_seen()
        except OSError:
            return True
        finally:
            self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()

    def _goaway_seen(self) -> bool:
        buffer = self._buffer
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if buffer[3] == GOAWAY:
                return True
            if len(buffer) < 9 + length:
                break
            buffer = buffer[9 + length:]
        self._buffer = buffer
        return False

    def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the server closed the connection")
            self._buffer += data
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def _read_frame(self) -> tuple[int, int, int, bytes]:
        head = self._read_exact(9)
        length = int.from_bytes(head[:3], "big")
        stream = struct.unpack(">I", head[5:9])[0] & 0x7FFFFFFF
        payload = self._read_exact(length)
        if head[3] == GOAWAY:
            raise EOFError("GOAWAY")
        return head[3], head[4], stream, payload
