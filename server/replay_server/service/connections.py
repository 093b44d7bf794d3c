"""Connections that make no call: closed after a short deadline, and capped per source address.

gRPC caps a port's connections (``max_connections``) and closes those idle
for ``idle_timeout_s``, but it cannot tell a client from an attacker: 600
connections that finished their HTTP/2 handshake and made no call filled the
port for everyone, renewably, without a token. :class:`ConnectionGuard`
watches the main port's connections from outside gRPC and closes:

* any connection that has made no call within ``handshake_timeout_s`` of
  being accepted (seconds; a real client calls within milliseconds of
  connecting: connecting is what its first call does);
* connections that have made no call yet, beyond
  ``max_idle_connections_per_host`` from one source address, and beyond
  a quarter of ``max_connections`` from all addresses together, the oldest
  first (so a new client's connection lives long enough to make its call).
  These caps spare connections younger than :data:`GRACE_S` while the port
  is below :data:`PRESSURE` of ``max_connections``, so that many actors
  connecting at once are not cut off between accept and their first call;
  under pressure (an attack filling the port) they apply at once.

A *call* is a replay call the server admitted, which with ``auth_token_env``
means one carrying the token; health checks do not count (they need no
token), so no one without the token holds a connection past the deadline.
Connections that made a call are left to gRPC (``idle_timeout_s``), unless the port is
more than :data:`SHED` full: then the address holding the most connections loses its oldest
ones first, whatever they did, so that one flooding address (a call on each connection
makes them count as clients) cannot keep the port from everyone else.

How: a thread sweeps: it lists the process' socket descriptors
(``/proc/self/fd``), learns each new socket's addresses once (through a
duplicate in a descriptor slot of its own, checked to be the same socket),
and shuts the chosen ones down through such a duplicate: gRPC sees the peer
go away and closes its own descriptor. The guard never closes a descriptor
it did not open, and needs no new one to close one; listing them takes one, so
with none left a sweep does nothing (it forgets no call) until one is free.

When: gRPC accepts connections itself (the guard cannot refuse one at
accept), and refuses everyone once ``max_connections`` are open, so what
keeps a legitimate client admitted is the guard trimming a burst before it
fills the port. Measured at full size, sweeping every 100 ms was too slow:
a burst of 256 connections arrived between two sweeps and filled the 512
(half of them the callless connections the guard kept). So the guard looks
every :data:`CHECK_S` at how many descriptors the process has open (one
``stat``) and sweeps at once when there are more than at its last sweep
(else every :data:`SWEEP_S`, for the deadlines); it keeps at most a quarter
of the port in callless connections from all addresses together, so a burst
must open three quarters of the port within one reaction (a few
milliseconds, plus the sweep: about 0.1 ms per new connection) to refuse
anyone. Cost when idle: a ``stat`` every :data:`CHECK_S` and one
``readlink`` per open descriptor per sweep. Linux only; elsewhere it does
nothing (said once in the log).

With a :class:`~replay_server.service.control_meter.ControlMeter`, each sweep
at most every :data:`~replay_server.service.control_meter.LOOK_S` also reads
every connection's byte counts (``TCP_INFO``, through the same slot) and cuts
the connections sending bytes that carry no call faster than it allows
(HTTP/2 SETTINGS, WINDOW_UPDATE and PRIORITY floods, which gRPC does not limit).

It also reports whether the port is *full* (as many connections as gRPC
admits): new clients are refused then, and health says NOT_SERVING, on
every listener, so that health reflects what clients see.

Thread-safety: :meth:`called` from any thread (the event loop); the sweep
runs on the guard's own thread.
"""

from __future__ import annotations

import heapq
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from replay_server.service.control_meter import LOOK_S, ControlMeter, tcp_bytes
from replay_server.service.peer_address import normal, peer_address

log = logging.getLogger("replay_server")

SWEEP_S = 0.1
"""Seconds between sweeps while nothing is to be closed."""

BUSY_SWEEP_S = 0.01
"""Seconds between sweeps while connections are being closed (an attack in progress): a
burst is trimmed before it fills the port."""

GRACE_S = 0.15
"""A connection this young is spared by the caps on idle connections, unless under pressure:
a client's first call follows its connection within milliseconds, but a busy server may
admit it later, and many actors of one host may connect at once. (With 0.05 s and the
guard seeing connections within milliseconds, 15 to 78 of 100 connections opened at once
from one address were cut before their call was admitted; with 0.15 s, none. An attack
gains nothing from it: from :data:`PRESSURE` on, the caps apply at once.)"""

PRESSURE = 0.25
"""Share of ``max_connections`` open from which the caps spare no young connection."""

SHED = 0.75
"""Share of ``max_connections`` past which connections that made a call are closed too, from
the address holding the most (its oldest first, never below ``max_idle_connections_per_host``
of an address) down to this share: one address that filled
the port with connections of one call each (511 of 512, without a token) refused every
other client and health for ``idle_timeout_s``, renewably; now it loses its own connections
first and the last quarter of the port stays for everyone else."""

CHECK_S = 0.005
"""Seconds between looks at how many descriptors the process has open (one ``stat``): any
more than at the last sweep, and the guard sweeps at once."""

_FD_DIR = "/proc/self/fd"


def _descriptor_count() -> int:
    """Descriptors this process has open: ``stat`` of ``/proc/self/fd`` gives the count in
    ``st_size`` on Linux 6.2 and later (microseconds); earlier kernels say 0, and the
    directory is listed instead."""
    try:
        count = os.stat(_FD_DIR).st_size
        return count if count > 0 else len(os.listdir(_FD_DIR))
    except OSError:
        return 0


@dataclass(slots=True)
class _Connection:
    """One connection to the port, with the instants that decide its fate.

    The instants are stored once, when the guard first sees the connection, and
    each sweep compares its clock against them (``now >= deadline``). Comparing
    recomputed differences instead (``now - accepted >= timeout``) fails for about
    half of all clock values: ``t + 0.15`` is rounded, so ``(t + 0.15) - t`` is
    ``0.14999999999963`` for ``t = 4400.19``, and a sweep at exactly the end of a
    grace period kept the connection or not depending on the host's uptime.
    """

    peer: tuple[str, int]
    accepted: float  # monotonic time the guard first saw it (orders the oldest first)
    spared_until: float  # accepted + GRACE_S: the caps spare it before this instant
    deadline: float  # accepted + handshake_timeout_s: closed from then on without a call
    fd: int
    shut: bool = False  # shut down by the guard; gRPC has yet to close its descriptor


class ConnectionGuard:
    """Closes a port's connections that make no call (see the module docstring).

    Args:
        port: the main port's number.
        handshake_timeout_s: seconds a connection may go without a call.
        max_idle_per_host: connections without a call kept per source address.
        max_idle: connections without a call kept in all.
        max_connections: what gRPC admits on the port (full at this many).
        on_full: called with True when the port becomes full, False when it is not
            any more (on the guard's thread).
        control: the control-frame meter (:mod:`~replay_server.service.control_meter`):
            every :data:`~replay_server.service.control_meter.LOOK_S` each connection's
            socket byte counts are read and judged, and a connection over it is cut.

    Attributes:
        closed: connections closed so far.
        open: connections to the port at the last sweep.
    """

    def __init__(self, port: int, *, handshake_timeout_s: float, max_idle_per_host: int,
                 max_idle: int, max_connections: int,
                 on_full: Callable[[bool], None] | None = None,
                 control: ControlMeter | None = None) -> None:
        self.port = port
        self.handshake_timeout_s = handshake_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self.max_idle = max_idle
        self.max_connections = max_connections
        self._on_full = on_full
        self.control = control
        self._next_look: float | None = None  # when the control meter looks next
        self._lock = threading.Lock()
        self._called: set[tuple[str, int]] = set()
        self._cuts: set[tuple[str, int]] = set()  # peers to close at the next sweep
        self._connections: dict[int, _Connection] = {}  # socket inode -> connection
        self._other: set[int] = set()  # inodes of sockets that are not the port's connections
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._slot: _Slot | None = _Slot()
        self.full = False
        self.closed = 0
        self.open = 0
        self._spared = 0

    @staticmethod
    def supported() -> bool:
        return os.path.isdir(_FD_DIR)

    def called(self, peer: str) -> None:
        """The connection of gRPC peer ``peer`` made a call (admitted): it is kept."""
        address = peer_address(peer)
        if address is not None:
            with self._lock:
                self._called.add(address)

    def cut(self, peer: str) -> None:
        """Close the connection of gRPC peer ``peer`` at the next sweep (soon: a cut wakes
        the guard), whatever it did (it abused HTTP/2: see ``reset_meter``). Any thread."""
        address = peer_address(peer)
        if address is not None:
            with self._lock:
                self._cuts.add(address)

    def start(self) -> None:
        """Sweep on a daemon thread until :meth:`stop`."""
        if not self.supported():
            log.info("connections without a call are not closed early on this platform (no "
                     "/proc/self/fd): gRPC's idle timeout applies")
            return
        self._thread = threading.Thread(target=self._run, name="replay-connections",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sweeping and close the guard's own descriptors (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return  # a sweep is stuck: leave the slot to it
        if self._slot is not None:
            self._slot.close()
            self._slot = None

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        swept_with = 0  # descriptors open at the last sweep
        while not self._stop.wait(CHECK_S):
            now = time.monotonic()
            if not (_descriptor_count() > swept_with or now >= next_sweep or self._cuts):
                continue
            try:
                busy = bool(self.sweep() or self._spared)
            except Exception:  # never let the guard die: it is a bound
                log.exception("connection sweep failed")
                busy = False
            next_sweep = now + (BUSY_SWEEP_S if busy else SWEEP_S)
            swept_with = _descriptor_count()

    def sweep(self, now: float | None = None) -> int:
        """Look at the port's connections once, close those to close; returns how many."""
        now = time.monotonic() if now is None else now
        sockets = self._sockets()
        if sockets is None:  # nothing is known this time: forget nothing, close nothing
            return 0
        for inode in [i for i in self._connections if i not in sockets]:
            gone = self._connections.pop(inode)
            with self._lock:
                self._called.discard(gone.peer)
        self._other.intersection_update(sockets)
        for inode, fd in sockets.items():
            known = self._connections.get(inode)
            if known is not None:
                known.fd = fd
            elif inode not in self._other:
                peer = self._peer_of(fd, inode)
                if peer is None:
                    self._other.add(inode)
                else:
                    self._connections[inode] = _Connection(
                        peer, now, now + GRACE_S, now + self.handshake_timeout_s, fd)
        doomed = self._doomed(now)
        # The byte look has its own interval (LOOK_S), whatever else this sweep closes: idle
        # connections doomed at every sweep must not hold off a frame flood's cut.
        doomed += [inode for inode in self._over_control(now) if inode not in doomed]
        closed = sum(self._shut(inode) for inode in doomed)
        self.closed += closed
        self.open = sum(not c.shut for c in self._connections.values())
        full = len(self._connections) >= self.max_connections
        if full != self.full:
            self.full = full
            log.warning("port %d %s", self.port,
                        f"is full ({len(self._connections)} connections): new clients are "
                        f"refused" if full else "accepts new clients again")
            if self._on_full is not None:
                self._on_full(full)
        return closed

    def _doomed(self, now: float) -> list[int]:
        """Inodes to close: no call past the deadline, or over a cap on idle connections.

        Over the per-address cap, an address' oldest go. Over the cap from all addresses
        together, the connections go from the address holding the most (its oldest first),
        one at a time: an attacker spread over many addresses loses its own connections
        before a client's single new one is touched, whatever order the sweep found them in.
        """
        with self._lock:
            called = set(self._called)
            cuts, self._cuts = self._cuts, set()
        abusers = [inode for inode, c in self._connections.items()
                   if c.peer in cuts and not c.shut]
        self._spared = 0  # over a cap, but young: looked at again soon
        pressed = len(self._connections) >= PRESSURE * self.max_connections
        doomed: list[int] = []
        hosts: dict[str, list[tuple[float, int]]] = {}
        for inode, connection in self._connections.items():
            if connection.peer in called or connection.shut:
                continue
            if now >= connection.deadline:
                doomed.append(inode)
            else:
                hosts.setdefault(connection.peer[0], []).append((connection.accepted, inode))
        over: list[tuple[float, int]] = []
        kept = 0
        for host, idle in hosts.items():
            idle.sort()  # oldest first
            cut = max(0, len(idle) - self.max_idle_per_host)
            over += idle[:cut]
            hosts[host] = idle[cut:]
            kept += len(idle) - cut
        over += _fair_cut(hosts, kept - self.max_idle)
        for _, inode in over:
            if pressed or now >= self._connections[inode].spared_until:
                doomed.append(inode)
            else:
                self._spared += 1
        doomed += abusers
        return doomed + self._shed(called, set(doomed))

    def _over_control(self, now: float) -> list[int]:
        """Inodes of connections over the control meter's limit, judged every
        :data:`~replay_server.service.control_meter.LOOK_S` (one ``getsockopt`` each: a look
        at 500 connections takes a few milliseconds), in every sweep that comes due, also
        those that close idle connections."""
        meter = self.control
        if meter is None or self._slot is None:
            return []
        if self._next_look is not None and now < self._next_look:
            return []
        self._next_look = now + LOOK_S
        over: list[int] = []
        live: set[tuple[str, int]] = set()
        for inode, connection in self._connections.items():
            if connection.shut:
                continue
            live.add(connection.peer)
            with self._slot.holding(connection.fd, inode) as sock:
                counts = None if sock is None else tcp_bytes(sock)
            if counts is None:
                continue
            if meter.over(connection.peer, counts[0], counts[1], now):
                over.append(inode)
        meter.keep(live)
        return over

    def _shed(self, called: set[tuple[str, int]], doomed: set[int]) -> list[int]:
        """Connections that made a call to close while more than :data:`SHED` of the port
        is open (after ``doomed``): the address holding the most loses its oldest first,
        and no address goes below ``max_idle_per_host`` (a port full of many clients of a
        few connections each is left to gRPC, as it was)."""
        staying = [(inode, c) for inode, c in self._connections.items()
                   if not c.shut and inode not in doomed]
        excess = len(staying) - int(SHED * self.max_connections)
        if excess <= 0:
            return []
        hosts: dict[str, list[tuple[float, int]]] = {}
        for inode, connection in staying:
            if connection.peer in called:
                hosts.setdefault(connection.peer[0], []).append((connection.accepted, inode))
        for host, connections in hosts.items():
            connections.sort()  # oldest first; an address keeps its newest per-address share
            hosts[host] = connections[:max(0, len(connections) - self.max_idle_per_host)]
        return [inode for _, inode in _fair_cut(hosts, excess)]

    def _sockets(self) -> dict[int, int] | None:
        """Socket inode -> descriptor, for every socket this process has open now; ``None``
        when the descriptors cannot be listed (listing takes a descriptor: at the open-file
        limit there is none). An empty answer then would have made every connection look
        gone and come back new: the calls they had made forgotten, and each connection
        (a learner's stream, say) shut at the deadline for making no call."""
        found: dict[int, int] = {}
        try:
            names = os.listdir(_FD_DIR)
        except OSError:
            return None
        for name in names:
            try:
                link = os.readlink(f"{_FD_DIR}/{name}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:["):
                found[int(link[8:-1])] = int(name)
        return found

    def _peer_of(self, fd: int, inode: int) -> tuple[str, int] | None:
        """The peer of the port's connection at ``fd`` (``None``: not one of them)."""
        if self._slot is None:
            return None
        with self._slot.holding(fd, inode) as sock:
            if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET, socket.AF_INET6):
                return None
            try:
                if sock.getsockname()[1] != self.port:
                    return None
                host, port = sock.getpeername()[:2]
            except OSError:  # not connected (a listener), or gone
                return None
            return normal(host), int(port)

    def _shut(self, inode: int) -> bool:
        """Shut the connection down (gRPC then closes its own descriptor); whether it was."""
        connection = self._connections.get(inode)
        if connection is None or self._slot is None:
            return False
        with self._slot.holding(connection.fd, inode) as sock:
            if sock is None:
                return False
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                return False
            connection.shut = True
            return True


def _fair_cut(hosts: dict[str, list[tuple[float, int]]],
              excess: int) -> list[tuple[float, int]]:
    """``excess`` connections taken from the addresses holding the most, one at a time, each
    address' oldest first (``hosts``: address -> its connections, oldest first).
    O(excess log addresses)."""
    if excess <= 0:
        return []
    heap = [(-len(idle), idle[0][0], host) for host, idle in hosts.items() if idle]
    heapq.heapify(heap)
    taken: list[tuple[float, int]] = []
    position = dict.fromkeys(hosts, 0)
    while heap and len(taken) < excess:
        negative, _, host = heapq.heappop(heap)
        idle = hosts[host]
        taken.append(idle[position[host]])
        position[host] += 1
        if negative + 1 < 0:
            heapq.heappush(heap, (negative + 1, idle[position[host]][0], host))
    return taken


class _Slot:
    """A descriptor of the guard's own, into which another socket is duplicated for a look.

    Opened once (two descriptors on ``/dev/null``), so looking at a connection
    needs no new descriptor, even when the process has none left: ``dup2``
    onto the slot, check it is the socket meant (the descriptor may have been
    closed and reused meanwhile), use it, then point the slot back at
    ``/dev/null``. The other process' descriptors are never closed.
    """

    def __init__(self) -> None:
        self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._slot = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    @contextmanager
    def holding(self, fd: int, inode: int) -> Iterator[socket.socket | None]:
        """A socket object on the slot, duplicated from ``fd``, if ``fd`` is socket ``inode``."""
        try:
            os.dup2(fd, self._slot)
        except OSError:
            yield None
            return
        sock = None
        try:
            if os.fstat(self._slot).st_ino == inode:
                sock = socket.socket(fileno=self._slot)
        except OSError:
            sock = None
        try:
            yield sock
        finally:
            if sock is not None:
                sock.detach()  # the slot stays open: pointed back at /dev/null below
            os.dup2(self._null, self._slot)

    def close(self) -> None:
        os.close(self._slot)
        os.close(self._null)
