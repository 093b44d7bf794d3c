"""Bytes a connection sends that carry no call: the HTTP/2 control-frame meter.

An HTTP/2 client may send SETTINGS, WINDOW_UPDATE and PRIORITY frames as
often as it likes. gRPC's C core (1.85) parses each, with no rate limit and
no channel argument for one: 200,000 of each on one connection were all
taken (docs/service.md, "Measured under attack"). Such frames reach no
Python code, so the server judges them by what it can see: the bytes the
connection's socket received (the kernel counts them: ``TCP_INFO``'s
``tcpi_bytes_received``) against the bytes that arrived as call messages
(admission reads every request, and tells this meter its size). What is left
over is *control*: HEADERS, frame headers, PINGs, SETTINGS, WINDOW_UPDATEs.

A legitimate client's control is small and proportional to what it does, so
each connection is allowed, besides its message bytes:

* :data:`CALL_BYTES` per call admitted (its HEADERS, its trailers' framing),
* :data:`MESSAGE_BYTES` per message (the 5-byte gRPC prefix, its last DATA
  frame's header), and one byte per :data:`FRAME_SHARE` message bytes (a
  9-byte DATA frame header per 16 KiB frame: 4 KB of a 7 MB insert; a flat
  64 bytes per message made an actor inserting 7 MB batches back to back,
  40 a second, send 160 KB a second of frame headers "carrying no call", and
  its connection was cut within a minute),
* one byte per :data:`SENT_SHARE` bytes the server sent it and it
  acknowledged (``tcpi_bytes_acked``): the WINDOW_UPDATEs and flow-control
  PINGs of a learner receiving batches,
* the request bytes a call declared (what admission reserved for it) while
  it is being read (:meth:`ControlMeter.expect`): a 7 MB insert arrives over
  milliseconds to seconds before it is read whole and counted, and a stream
  may always have a message on its way,
* per call the server refused, or that ended, after it spoke but before its
  request was read, what it had declared (at least :data:`REFUSED_BYTES`):
  its client may have sent that much of the request, which nobody reads (a
  client retrying at once a 7 MB insert refused after its first 4 MB chunk
  sent 114 KB on average and up to 3 MB beyond it each time). A flooder may
  buy control bytes so, but only with calls that sent a first message (a
  reset, or a call that sends nothing until its deadline, buys nothing), each
  costing the server an admission, a read, a refusal and its answer,

and within each window of :data:`WINDOW_S` at most
``server.max_control_bytes_per_s`` times the window plus :data:`FLOOR_BYTES`
more. A connection over it at two looks in a row (bytes that arrived just
before the call they belong to was admitted are counted by the next look) is
cut (the connection guard shuts its socket:
:meth:`~replay_server.service.connections.ConnectionGuard.cut`) and one line
logged (rate-limited per host). Measured (``benchmarks/control_bytes.py``,
2026-11-28): a learner taking 1.8 MB and 7.2 MB batches at 290 and 490 MB/s
sent 22 and 9 bytes of control per MB it took, actors 83 to 89 bytes per
call; after the allowances none came within 17 bytes of a window's limit
(131,072 bytes at the default of 64 KiB a second). An actor inserting 7.2 MB
batches (2026-11-29) sent 4,082 bytes per call, 45 calls a second: a peak of
301,509 bytes in a window before :data:`FRAME_SHARE`, none after.

The windows start at the connection's first look and follow each other; a
window's control is the growth of (received - allowed) over it, less the
request bytes expected now (those may have arrived, in part, before the
window began), so neither credit nor debt carries from one window to the
next.

Calls that never reach admission (health checks, calls refused for their
token) earn no allowance: their bytes count as control.

Cost: a lock and a dictionary update per message (event loop); per
connection per look (the guard's thread, every :data:`LOOK_S`): one
``getsockopt`` and a few arithmetic operations. Thread-safety: any thread.
"""

from __future__ import annotations

import logging
import socket
import struct
import sys
import threading
from dataclasses import dataclass

from replay_server.service.limits import WINDOW_BYTES
from replay_server.service.peer_address import peer_address
from replay_server.service.status import CLIENT_LOG

CALL_BYTES = 512
"""Control allowed per call admitted: its HEADERS (a first call's are a few hundred bytes,
later ones a few dozen with HPACK), and its end's frames."""

MESSAGE_BYTES = 64
"""Control allowed per message: the gRPC prefix and its DATA frames' headers."""

FRAME_SHARE = 1024
"""One byte of control allowed per this many message bytes: the DATA frames' 9-byte headers
(one per 16 KiB frame, the HTTP/2 default; smaller frames where flow control splits them)."""

SENT_SHARE = 256
"""One byte of control allowed per this many bytes the server sent (acknowledged): a
receiver's WINDOW_UPDATEs and flow-control PINGs (13 and 17 bytes per window's worth)."""

REFUSED_BYTES = 2 * WINDOW_BYTES
"""Control allowed at least per call refused (or ended) before its request was read: a
stream's flow-control window, and as much again for what the client had on its way."""

FLOOR_BYTES = 64 << 10
"""Control allowed per window besides the rate: a connection's opening (preface, SETTINGS),
keepalive PINGs, bursts."""

WINDOW_S = 1.0
"""Seconds over which the rate is judged."""

LOOK_S = 0.2
"""Seconds between the guard's looks at each connection's bytes."""

_TCP_INFO = getattr(socket, "TCP_INFO", 11 if sys.platform.startswith("linux") else None)
_ACKED_AT = 120  # struct tcp_info: __u64 tcpi_bytes_acked (Linux 4.1 and later)
_RECEIVED_AT = 128  # __u64 tcpi_bytes_received
_INFO_BYTES = 136


def tcp_bytes(sock: socket.socket) -> tuple[int, int] | None:
    """``(bytes received, bytes sent and acknowledged)`` of a TCP socket, from ``TCP_INFO``;
    ``None`` where the kernel does not say (not Linux, a kernel before 4.1, not TCP)."""
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_BYTES)
    except OSError:
        return None
    if len(info) < _INFO_BYTES:
        return None
    acked, received = struct.unpack_from("=QQ", info, _ACKED_AT)
    return received, acked


def supported() -> bool:
    """Whether this platform counts a socket's bytes (``TCP_INFO`` with byte counts)."""
    with socket.socket() as sock:
        return tcp_bytes(sock) is not None


@dataclass(slots=True)
class _Account:
    """One connection's calls and message bytes, and its current window."""

    calls: int = 0
    messages: int = 0
    message_bytes: int = 0
    window_end: float | None = None  # the instant the current window ends (None: no look yet)
    base: int = 0  # control at the window's start (refused calls' credit aside)
    refused: int = 0  # credit for calls refused before their request was read
    refused_base: int = 0  # ... at the window's start
    expected: int = 0  # request bytes declared by calls being read now
    suspect: tuple[int, int] | None = None  # (base, refused_base) of a window found over
    cut: bool = False
    gone: bool = False  # not among the connections open at the last look
    peer: str | None = None  # its gRPC peer string, once a call told it


class ControlMeter:
    """Per connection, control bytes (received beyond calls) within a window (see the module
    docstring).

    Args:
        limit_per_s: control bytes a connection may send a second (``server.max_control_bytes_per_s``).
        floor_bytes: control bytes allowed per window besides the rate.
        window_s: the window, in seconds.

    Attributes:
        cut: connections found over the limit so far.
        peak: the most control bytes one connection has sent within one window so far
            (what a workload needs of the limit: ``benchmarks/control_bytes.py``).
    """

    def __init__(self, limit_per_s: float, floor_bytes: int = FLOOR_BYTES,
                 window_s: float = WINDOW_S) -> None:
        self.limit = limit_per_s
        self.window_s = window_s
        self.allowed = int(limit_per_s * window_s) + floor_bytes
        """Control bytes a connection may send within one window."""
        self.cut = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._accounts: dict[tuple[str, int], _Account] = {}
        self._addresses: dict[str, tuple[str, int] | None] = {}  # gRPC peer -> (ip, port)

    def called(self, peer: str) -> None:
        """A call of gRPC peer ``peer`` was admitted. Any thread."""
        with self._lock:
            account = self._account(peer)
            if account is not None:
                account.calls += 1

    def message(self, peer: str, nbytes: int) -> None:
        """A message of ``nbytes`` arrived on a call of gRPC peer ``peer``. Any thread."""
        with self._lock:
            account = self._account(peer)
            if account is not None:
                account.messages += 1
                account.message_bytes += nbytes

    def expect(self, peer: str, nbytes: int) -> None:
        """Calls of gRPC peer ``peer`` are reading ``nbytes`` more request bytes than before
        (negative: fewer; a call read whole, or ended). Any thread."""
        with self._lock:
            account = self._account(peer)
            if account is not None:
                account.expected += nbytes

    def refused(self, peer: str, declared: int = 0) -> None:
        """A call of gRPC peer ``peer`` that had declared ``declared`` request bytes was
        refused, or ended, before its request was read (what its client sent of it is
        allowed, see the module docstring). Any thread."""
        with self._lock:
            account = self._account(peer)
            if account is not None:
                account.refused += max(REFUSED_BYTES, declared)

    def _account(self, peer: str) -> _Account | None:
        """The account of gRPC peer ``peer``'s connection (``None``: not a TCP one); the
        caller holds the lock."""
        if peer in self._addresses:
            address = self._addresses[peer]
        else:
            address = self._addresses[peer] = peer_address(peer)
        if address is None:
            return None
        account = self._accounts.get(address)
        if account is None:
            account = self._accounts[address] = _Account(peer=peer)
        return account

    def over(self, address: tuple[str, int], received: int, sent: int, now: float) -> int:
        """Judge connection ``address`` (``(ip, port)``) at instant ``now``, its socket having
        received ``received`` bytes and sent ``sent`` (acknowledged) so far: the control bytes
        of the current window if it just went over the limit (said once per connection), else
        0. Any thread."""
        with self._lock:
            account = self._accounts.get(address)
            if account is None:
                account = self._accounts[address] = _Account()
            account.gone = False
            control = _control(account, received, sent)
            if account.cut:
                return 0
            if account.suspect is not None:  # over at the last look: still over from there?
                growth = (control - account.suspect[0] - (account.refused - account.suspect[1])
                          - account.expected)
                account.suspect = None
                if growth > self.allowed:
                    account.cut = True
                    self.cut += 1
                    self._say(address, growth)
                    return growth
            if account.window_end is None or now >= account.window_end:  # a window starts
                growth = self._growth(account, control) if account.window_end else 0
                window = (account.base, account.refused_base)
                account.window_end, account.base = now + self.window_s, control
                account.refused_base = account.refused
            else:
                growth = self._growth(account, control)
                window = (account.base, account.refused_base)
            self.peak = max(self.peak, growth)
            if growth > self.allowed:
                account.suspect = window  # judged again at the next look, from the same start
            return 0

    def control(self, address: tuple[str, int], received: int, sent: int) -> int | None:
        """The control bytes of connection ``address`` since it was first counted, its socket
        having received ``received`` bytes and sent ``sent`` (acknowledged): what arrived
        beyond its calls' allowances (negative: allowances unused); ``None``: not counted.
        Any thread."""
        with self._lock:
            account = self._accounts.get(address)
            return None if account is None else _control(account, received, sent)

    def _growth(self, account: _Account, control: int) -> int:
        """The control of ``account`` within its window, ``control`` being its count now."""
        return (control - account.base - (account.refused - account.refused_base)
                - account.expected)

    def _say(self, address: tuple[str, int], nbytes: int) -> None:
        """The log line for a connection cut (rate-limited per host, like the reset meter's)."""
        host, port = address
        peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        CLIENT_LOG.log(peer, "control", logging.WARNING, "%s sent %d bytes carrying no call "
                       "(HTTP/2 control frames: SETTINGS, WINDOW_UPDATE, PRIORITY, PING?) within "
                       "%g s, more than server.max_control_bytes_per_s = %d allows: its "
                       "connection is closed", peer, nbytes, self.window_s, self.limit)

    def keep(self, live: set[tuple[str, int]]) -> None:
        """Forget the connections not in ``live`` (the connections open now) at two looks in
        a row: a connection whose call was counted before the guard first saw it keeps its
        count. O(connections counted). Any thread."""
        with self._lock:
            for address in [a for a in self._accounts if a not in live]:
                account = self._accounts[address]
                if not account.gone:
                    account.gone = True
                    continue
                del self._accounts[address]
                if account.peer is not None:
                    self._addresses.pop(account.peer, None)


def _control(account: _Account, received: int, sent: int) -> int:
    """Bytes ``account``'s connection sent beyond what its calls account for (see the module
    docstring), its socket having received ``received`` and sent ``sent`` (acknowledged)."""
    return received - (account.message_bytes + account.message_bytes // FRAME_SHARE
                       + CALL_BYTES * account.calls + MESSAGE_BYTES * account.messages
                       + sent // SENT_SHARE)
