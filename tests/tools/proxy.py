"""``LinkProxy``: a TCP proxy on 127.0.0.1 that puts a slow or faulty network between two processes.

Tests put it between a real client and a real server to give the loopback
link what a real network has: added delay (each direction, every byte late
by the same amount, without limiting throughput), a bandwidth cap, stalls (no
byte moves while the connections stay open, as on a congested or partitioned
link) and resets (every connection closed with a TCP RST, as when a NAT or a
load balancer drops it). It runs an asyncio loop on a thread of its own.

Bounds: each direction of a connection buffers at most :data:`QUEUE_CHUNKS`
chunks of :data:`CHUNK_BYTES`; past that it stops reading, so TCP's flow
control holds the sender back.

Use::

    with LinkProxy(server.address, delay_s=0.005) as proxy:
        client = ReplayClient(proxy.address)
        ...
        proxy.stall(); ...; proxy.resume()
        proxy.reset()
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 256


@dataclass
class ProxyStats:
    """What went through: connections accepted and reset, bytes each way."""

    connections: int = 0
    resets: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class LinkProxy:
    """See the module docstring.

    Args:
        target: ``host:port`` to forward to.
        delay_s: one-way delay added in each direction (the round trip grows by twice it).
        bandwidth: bytes per second each direction may carry (``None``: no cap).
        source: the loopback address its connections to ``target`` come from (e.g.
            ``"127.0.0.3"``: the server sees another client host); ``None``: the system's.
    """

    def __init__(self, target: str, *, delay_s: float = 0.0, bandwidth: float | None = None,
                 source: str | None = None) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self.delay_s = delay_s
        self.bandwidth = bandwidth
        self._source = None if source is None else (source, 0)
        self.stats = ProxyStats()
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.address = f"127.0.0.1:{self._port}"

    # ------------------------------------------------------------ control (any thread)

    def stall(self) -> None:
        """Stop moving bytes (both ways, every connection); they wait, connections stay open."""
        self._call(lambda: self._flowing.clear())  # type: ignore[union-attr]

    def resume(self) -> None:
        """Move bytes again, the waiting ones first."""
        self._call(lambda: self._flowing.set())  # type: ignore[union-attr]

    def reset(self) -> None:
        """Close every open connection with a TCP RST (bytes in the proxy are dropped)."""
        done = threading.Event()

        def kill() -> None:
            for writer in list(self._writers):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                    except OSError:
                        pass
                writer.transport.abort()
            self._writers.clear()
            self.stats.resets += 1
            done.set()

        self._loop.call_soon_threadsafe(kill)
        done.wait(10)

    def close(self) -> None:
        """Drop every connection and stop (the loop ends once its tasks have)."""
        self.reset()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the loop

    def _call(self, fn) -> None:  # type: ignore[no-untyped-def]
        self._loop.call_soon_threadsafe(fn)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing = asyncio.Event()
        self._flowing.set()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0, limit=CHUNK_BYTES))
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _accept(self, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(
                *self._target, local_addr=self._source)
        except OSError:
            client_writer.transport.abort()
            return
        self.stats.connections += 1
        self._writers.update((client_writer, server_writer))
        try:
            await asyncio.gather(self._pump(client_reader, server_writer, "bytes_up"),
                                 self._pump(server_reader, client_writer, "bytes_down"),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # the proxy is closing
            pass
        finally:
            for writer in (client_writer, server_writer):
                self._writers.discard(writer)
                writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    counter: str) -> None:
        """One direction: read chunks as they come, write each ``delay_s`` after it was read,
        no faster than ``bandwidth``, only while flowing."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)

        async def read() -> None:
            try:
                while True:
                    data = await reader.read(CHUNK_BYTES)
                    await queue.put((time.monotonic() + self.delay_s, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                await queue.put((0.0, b""))

        async def write() -> None:
            next_free = time.monotonic()
            while True:
                due, data = await queue.get()
                if not data:
                    writer.transport.abort()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()  # type: ignore[union-attr]
                if self.bandwidth:
                    now = time.monotonic()
                    next_free = max(next_free, now) + len(data) / self.bandwidth
                    if next_free > now:
                        await asyncio.sleep(next_free - now)
                writer.write(data)
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                await writer.drain()

        reading = asyncio.ensure_future(read())
        try:
            await write()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
