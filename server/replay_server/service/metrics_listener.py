"""The ``/metrics`` HTTP listener, bounded: a few threads, a few connections, a timeout each.

prometheus_client's own server starts a thread per connection and waits for
each request for ever: ~1,000 idle sockets took 1,000 threads and every
descriptor of the process, locking clients out of the replay port and
failing timed checkpoints (EMFILE). This one accepts on its own thread, hands
each connection to a pool of :data:`THREADS` threads, holds at most
:data:`~replay_server.service.limits.METRICS_MAX_CONNECTIONS` connections at
once (waiting ones included; more are closed at once), and gives each
:data:`~replay_server.service.limits.SIDE_LISTENER_IDLE_S` seconds per read
or write (one request per connection: HTTP/1.0). A scrape needs one
connection for well under a second.

Thread-safety: :meth:`start` and :meth:`stop` from one thread; requests are
served on the pool.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer
from typing import Any

from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from replay_server.service.limits import METRICS_MAX_CONNECTIONS, SIDE_LISTENER_IDLE_S

THREADS = 2
"""Threads serving scrapes."""


class _BoundedServer(HTTPServer):
    """An HTTPServer that serves on a fixed pool and caps the connections it holds."""

    request_queue_size = METRICS_MAX_CONNECTIONS

    def __init__(self, address: tuple[str, int], handler: type, family: int) -> None:
        self.address_family = family
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="replay-metrics")
        self._lock = threading.Lock()
        self.held = 0
        self.refused = 0
        super().__init__(address, handler)  # binds: a failure closes the pool too

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = self.held >= METRICS_MAX_CONNECTIONS
            if not full:
                self.held += 1
        if full:
            self.refused += 1
            self.shutdown_request(request)
            return
        request.settimeout(SIDE_LISTENER_IDLE_S)
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a broken or slow scraper: drop it
            pass
        finally:
            self.shutdown_request(request)
            with self._lock:
                self.held -= 1

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class MetricsListener:
    """Serves ``registry`` at ``/metrics`` on ``host:port`` (see the module docstring).

    Args:
        host: the address to listen on (IPv6 without brackets).
        port: the port (0: any free one).
        registry: what a scrape returns.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, registry: Collector) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = _BoundedServer((host, port), MetricsHandler.factory(registry), family)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={
            "poll_interval": 0.2}, name="replay-metrics-accept", daemon=True)

    @property
    def refused(self) -> int:
        """Connections closed at once because :data:`METRICS_MAX_CONNECTIONS` were held."""
        return self._server.refused

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close the listener (idempotent); scrapes in progress are dropped."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

