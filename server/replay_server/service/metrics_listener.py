"""The ``/metrics`` HTTP listener, bounded: slow scrapers cannot block others.

prometheus_client's own server starts a thread per connection and waits for
each request for ever: ~1,000 idle sockets took 1,000 threads and every
descriptor of the process, locking clients out of the replay port and
failing timed checkpoints (EMFILE). A first bound (a pool of 2 threads, each
connection read there with a timeout per read) let two slow connections
hold both threads: scrapes failed 4 times in 8 with 2 slow connections open,
every time with 8 (issue 34, item 9).

So requests are *read* off the pool: one thread accepts connections and
reads their requests, non-blocking, on a selector, and only a request that
has fully arrived (its head: a scrape has no body) goes to the pool of
:data:`THREADS` threads, which answers it at once (HTTP/1.0, one request a
connection). A connection may take :data:`REQUEST_DEADLINE_S` in all to
send its request (not per read: a byte every few seconds does not extend
it) and :data:`WRITE_TIMEOUT_S` per write of the answer; at most
:data:`~replay_server.service.limits.METRICS_MAX_CONNECTIONS` connections
are held at once, and when a new one comes while they are, the oldest that
has not sent its request yet is closed for it (a scraper sends its request
within milliseconds of connecting), else the new one is. A request head
over :data:`MAX_REQUEST_BYTES` closes its connection.

Thread-safety: :meth:`MetricsListener.start` and :meth:`MetricsListener.stop`
from one thread; requests are read on the listener's thread and answered on
the pool.
"""

from __future__ import annotations

import io
import selectors
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from replay_server.service.limits import METRICS_MAX_CONNECTIONS

THREADS = 2
"""Threads answering scrapes whose request has arrived."""

REQUEST_DEADLINE_S = 5.0
"""How long a connection may take, from its accept, to send its whole request."""

WRITE_TIMEOUT_S = 5.0
"""How long one write of an answer may wait for its reader."""

MAX_REQUEST_BYTES = 16 << 10
"""The largest request head read (a scrape's is a few hundred bytes)."""

_TICK_S = 0.2
"""How often the listener's thread looks for expired requests and for :meth:`stop`."""


class _Pending:
    """A connection whose request has not fully arrived: its socket, bytes so far, deadline."""

    __slots__ = ("sock", "address", "head", "deadline")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock, self.address, self.head, self.deadline = sock, address, b"", deadline


class MetricsListener:
    """Serves ``registry`` at ``/metrics`` on ``host:port`` (see the module docstring).

    Args:
        host: the address to listen on (IPv6 without brackets).
        port: the port (0: any free one).
        registry: what a scrape returns.

    Attributes:
        refused: connections closed at once because the cap was reached and none
            was waiting for its request.
        shed: connections closed before their request arrived: past
            :data:`REQUEST_DEADLINE_S`, over :data:`MAX_REQUEST_BYTES`, or the oldest
            such when a new connection needed the room.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, registry: Collector) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(METRICS_MAX_CONNECTIONS)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port = int(self._listener.getsockname()[1])
        self._handler = _handler_for(registry)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="replay-metrics")
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self._serving = 0  # connections handed to the pool, not yet closed
        self._stopping = threading.Event()
        self.refused = 0
        self.shed = 0
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="replay-metrics-accept",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close the listener and every connection not answered yet
        (idempotent); answers being written are dropped."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for pending in list(self._pending.values()):
            pending.sock.close()
        self._pending.clear()
        try:
            self._selector.close()
        except (OSError, ValueError):
            pass
        self._listener.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ the listener's thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                events = self._selector.select(_TICK_S)
            except (OSError, ValueError):
                return  # closed by stop()
            for key, _ in events:
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._expire(time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors, or closed: try again on the next event
            if not self._make_room():
                self.refused += 1
                _close(sock)
                continue
            sock.setblocking(False)
            pending = _Pending(sock, address, time.monotonic() + REQUEST_DEADLINE_S)
            self._pending[sock] = pending
            self._selector.register(sock, selectors.EVENT_READ)

    def _make_room(self) -> bool:
        """Whether a new connection may be held: under the cap, or once the oldest connection
        still sending its request was closed for it."""
        with self._lock:
            held = self._serving + len(self._pending)
        if held < METRICS_MAX_CONNECTIONS:
            return True
        if not self._pending:
            return False
        oldest = next(iter(self._pending))
        self._drop(oldest)
        return True

    def _read(self, sock: socket.socket) -> None:
        pending = self._pending.get(sock)
        if pending is None:
            return
        try:
            data = sock.recv(MAX_REQUEST_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock, shed=False)  # the client went away
            return
        pending.head += data
        if b"\r\n\r\n" in pending.head or b"\n\n" in pending.head:
            self._selector.unregister(sock)
            del self._pending[sock]
            with self._lock:
                self._serving += 1
            sock.setblocking(True)
            sock.settimeout(WRITE_TIMEOUT_S)
            self._pool.submit(self._answer, pending)
        elif len(pending.head) >= MAX_REQUEST_BYTES:
            self._drop(sock)

    def _expire(self, now: float) -> None:
        """Close connections whose request did not arrive by their deadline (oldest first)."""
        for sock, pending in list(self._pending.items()):
            if pending.deadline > now:
                return
            self._drop(sock)

    def _drop(self, sock: socket.socket, shed: bool = True) -> None:
        self._pending.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        self.shed += shed  # before the close: whoever sees the close sees it counted
        _close(sock)

    # ------------------------------------------------------------ the pool

    def _answer(self, pending: _Pending) -> None:
        try:
            self._handler(pending.sock, pending.address, pending.head)
        except Exception:  # noqa: BLE001 - a broken or slow scraper: drop it
            pass
        finally:
            _close(pending.sock)
            with self._lock:
                self._serving -= 1


def _handler_for(registry: Collector) -> Any:
    """prometheus_client's request handler for ``registry``, reading its request from the head
    already read (``handler(sock, address, head)`` answers it on ``sock``)."""
    base = MetricsHandler.factory(registry)

    class Handler(base):  # type: ignore[valid-type, misc]
        def __init__(self, sock: socket.socket, address: Any, head: bytes) -> None:
            self._head = head
            super().__init__(sock, address, None)

        def setup(self) -> None:
            super().setup()
            self.rfile = io.BytesIO(self._head)

        def log_message(self, *_: Any) -> None:  # the server logs nothing per scrape
            pass

    return Handler


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
