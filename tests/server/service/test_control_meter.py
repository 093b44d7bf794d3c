"""ControlMeter: a connection's bytes beyond its calls, judged per window (the clock injected),
and the connection guard cutting a real socket that sends bytes no call accounts for."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from replay_server.service import control_meter
from replay_server.service.connections import ConnectionGuard
from replay_server.service.control_meter import (
    CALL_BYTES,
    FRAME_SHARE,
    MESSAGE_BYTES,
    SENT_SHARE,
    ControlMeter,
    tcp_bytes,
)
from tests.conftest import wait_for

PEER = "ipv4:10.0.0.7:5000"
ADDRESS = ("10.0.0.7", 5000)
T0 = 4400.19  # a clock value where (t + 0.15) - t < 0.15 in floating point


def meter(limit: int = 1000, floor: int = 500) -> ControlMeter:
    return ControlMeter(limit, floor_bytes=floor, window_s=1.0)  # 1,500 bytes a window


def test_message_bytes_and_the_allowances_are_not_control() -> None:
    m = meter()
    assert not m.over(ADDRESS, 0, 0, T0)  # the first look starts the first window
    m.called(PEER)
    for _ in range(10):
        m.message(PEER, 100_000)
    allowed = (1_000_000 + 1_000_000 // FRAME_SHARE + CALL_BYTES + 10 * MESSAGE_BYTES
               + 100_000_000 // SENT_SHARE)
    assert not m.over(ADDRESS, allowed + 1_500, 100_000_000, T0 + 0.5)  # exactly the limit
    assert not m.over(ADDRESS, allowed + 1_500, 100_000_000, T0 + 0.7)
    assert not m.over(ADDRESS, allowed + 1_501, 100_000_000, T0 + 0.9)  # over: judged again
    assert m.over(ADDRESS, allowed + 1_501, 100_000_000, T0 + 1.1)


@pytest.mark.parametrize("frame_share", [FRAME_SHARE, 1 << 62])
def test_an_actor_inserting_7_mb_batches_back_to_back_is_never_cut(
        frame_share: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each 7.2 MB insert (two messages: 4.1 and 3.1 MB) arrives in 16 KiB DATA frames, each
    behind a 9-byte header: 4 KB of control per call. At 40 inserts a second that is 160 KB a
    second, more than the default limit's window (64 KiB a second and a 64 KiB floor); a flat
    allowance per message had the actor's connection cut (``1 << 62``: no frame allowance)."""
    monkeypatch.setattr(control_meter, "FRAME_SHARE", frame_share)
    m = ControlMeter(65536, window_s=1.0)
    m.over(ADDRESS, 0, 0, T0)
    received = 0
    for call in range(400):  # 10 s at 40 calls a second, a look every 0.2 s
        m.called(PEER)
        for part in (4_100_000, 3_126_000):
            frames = -(-part // 16384)
            received += part + 5 + 9 * frames
            m.message(PEER, part)
        received += 300  # the call's HEADERS (HPACK) and its END_STREAM frame
        if call % 8 == 7:
            m.over(ADDRESS, received, 10_000 * (call + 1), T0 + (call + 1) / 40)
    if frame_share == FRAME_SHARE:
        assert m.cut == 0 and m.peak < m.allowed // 2
    else:
        assert m.cut == 1  # the allowance as it was: cut


def test_a_connection_over_the_limit_at_two_looks_in_a_row_is_cut_once() -> None:
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    assert m.over(ADDRESS, 1_501, 0, T0 + 0.2) == 0  # over: judged again at the next look
    assert m.over(ADDRESS, 100_000, 0, T0 + 0.4) == 100_000
    assert m.over(ADDRESS, 200_000, 0, T0 + 0.6) == 0  # said once
    assert m.cut == 1


def test_bytes_counted_by_the_next_look_are_no_control() -> None:
    """A message that had arrived at a look, but was read (and counted) only after it."""
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    assert m.over(ADDRESS, 50_000, 0, T0 + 0.2) == 0  # 50 KB of a message not read yet
    m.message(PEER, 50_000)
    assert m.over(ADDRESS, 50_000, 0, T0 + 0.4) == 0
    assert m.over(ADDRESS, 50_000, 0, T0 + 0.6) == 0
    assert m.cut == 0


def test_each_window_is_judged_on_its_own_growth() -> None:
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    received = 0
    for look in range(1, 31):  # 1,400 bytes a window for 6 windows: never over
        received += 280
        assert not m.over(ADDRESS, received, 0, T0 + look * 0.2), look
    assert m.cut == 0
    # a window's last look is where the next one starts: 1,501 more within it is over
    assert not m.over(ADDRESS, received + 1_501, 0, T0 + 6.2 + 0.5)
    assert m.over(ADDRESS, received + 1_501, 0, T0 + 6.2 + 0.7)


def test_a_window_found_over_at_its_end_is_judged_again_from_its_start() -> None:
    """A flood of 1,600 bytes a window, each found over only at the window's end: the next
    look, in the next window, still sees the first window's excess and cuts."""
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    assert not m.over(ADDRESS, 1_600, 0, T0 + 1.0)
    assert m.over(ADDRESS, 1_700, 0, T0 + 1.2) == 1_700


def test_the_window_ends_at_its_stored_instant() -> None:
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    assert not m.over(ADDRESS, 1_400, 0, T0 + 1.0)  # the window's end: the next one starts
    assert not m.over(ADDRESS, 2_800, 0, T0 + 1.5)  # 1,400 within the second window
    assert not m.over(ADDRESS, 2_901, 0, T0 + 1.9)  # 1,501 within it
    assert m.over(ADDRESS, 2_901, 0, T0 + 1.95)


def test_credit_does_not_carry_into_the_next_window() -> None:
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    for _ in range(100):  # 512 bytes allowed each, none used: the window's control is negative
        m.called(PEER)
    assert not m.over(ADDRESS, 0, 0, T0 + 1.0)
    assert not m.over(ADDRESS, 1_501, 0, T0 + 1.2)
    assert m.over(ADDRESS, 1_501, 0, T0 + 1.4)  # the unused allowance bought nothing


def test_request_bytes_expected_are_no_control_until_the_call_is_read() -> None:
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    m.expect(PEER, 7_000_000)  # a 7 MB insert admitted: on its way
    assert not m.over(ADDRESS, 3_000_000, 0, T0 + 0.2)
    assert not m.over(ADDRESS, 6_000_000, 0, T0 + 0.4)
    m.expect(PEER, -7_000_000)  # read whole: counted as a message instead
    m.message(PEER, 7_000_000)
    assert not m.over(ADDRESS, 7_000_000, 0, T0 + 0.6)
    m.expect(PEER, 7_000_000)
    m.expect(PEER, -7_000_000)  # ended without sending: nothing allowed any more
    over = 7_001_501 + MESSAGE_BYTES + 7_000_000 // FRAME_SHARE  # the message's allowances
    assert not m.over(ADDRESS, over, 0, T0 + 0.8)
    assert m.over(ADDRESS, over, 0, T0 + 1.0)


def test_request_bytes_expected_are_allowed_in_a_window_that_began_after_the_call() -> None:
    """The guard's first look came after the call was admitted (a slow link: 3.6 MB over two
    seconds): what the call declared is allowed whenever it arrives."""
    m = meter()
    m.called(PEER)
    m.expect(PEER, 3_600_000)
    received = 0
    for look in range(10):
        received += 360_000
        assert not m.over(ADDRESS, received, 0, T0 + look * 0.2), look
    assert m.cut == 0


def test_calls_refused_unread_allow_what_their_clients_had_sent() -> None:
    m = meter()
    m.over(ADDRESS, 0, 0, T0)
    for _ in range(10):
        m.refused(PEER)
    received = 10 * control_meter.REFUSED_BYTES + 1_500
    assert not m.over(ADDRESS, received, 0, T0 + 0.2)
    assert not m.over(ADDRESS, received, 0, T0 + 0.4)
    assert not m.over(ADDRESS, received + 1, 0, T0 + 0.6)
    assert m.over(ADDRESS, received + 1, 0, T0 + 0.8)


def test_connections_are_forgotten_after_two_looks_without_them() -> None:
    m = meter()
    m.message(PEER, 10)
    m.keep(set())
    m.over(ADDRESS, 0, 0, T0)  # still known: its count was kept
    m.keep({ADDRESS})
    m.keep(set())
    assert ADDRESS in m._accounts
    m.keep(set())
    assert ADDRESS not in m._accounts and PEER not in m._addresses


def test_peers_that_name_no_connection_are_ignored() -> None:
    m = meter()
    m.called("unix:/tmp/sock")
    m.message("unknown", 5)
    assert m._accounts == {}


@pytest.mark.skipif(not control_meter.supported(), reason="needs TCP_INFO byte counts")
def test_tcp_info_counts_a_real_sockets_bytes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        with client, conn:
            client.sendall(b"x" * 5000)
            conn.sendall(b"y" * 700)
            # what was acknowledged may count the connection's SYN too (one byte)
            assert wait_for(lambda: tcp_bytes(conn)[0] == 5000 and tcp_bytes(conn)[1] in (700, 701))
            received, acked = tcp_bytes(client)
            assert received == 700 and acked in (5000, 5001)


@pytest.mark.skipif(not (control_meter.supported() and ConnectionGuard.supported()),
                    reason="needs TCP_INFO byte counts and /proc/self/fd")
def test_the_guard_cuts_the_connection_whose_bytes_carry_no_call() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        meter_ = ControlMeter(2_000, floor_bytes=0)
        guard = ConnectionGuard(port, handshake_timeout_s=1e6, max_idle_per_host=100,
                                max_idle=100, max_connections=100, control=meter_)
        flooder = socket.create_connection(("127.0.0.1", port))
        caller = socket.create_connection(("127.0.0.1", port))
        flooded, _ = listener.accept()
        called, _ = listener.accept()
        try:
            guard.sweep(T0)  # the first look
            caller_peer = "ipv4:127.0.0.1:%d" % caller.getsockname()[1]
            meter_.called(caller_peer)
            meter_.message(caller_peer, 50_000)
            caller.sendall(b"m" * 50_000)  # its bytes are a call's message
            flooder.sendall(b"w" * 3_000)  # bytes no call accounts for
            assert wait_for(lambda: tcp_bytes(flooded)[0] == 3_000 and tcp_bytes(called)[0] == 50_000)
            assert guard.sweep(T0 + 0.1) == 0  # within the look's interval: not judged yet
            assert guard.sweep(T0 + control_meter.LOOK_S) == 0  # over: judged again next look
            assert guard.sweep(T0 + 2 * control_meter.LOOK_S) == 1
            assert meter_.cut == 1
            flooder.settimeout(10)
            assert flooder.recv(1) == b""  # the flooder's connection was shut
            caller.setblocking(False)
            with pytest.raises(BlockingIOError):  # the caller's is open
                caller.recv(1)
        finally:
            guard.stop()
            for sock in (flooder, caller, flooded, called):
                sock.close()


@pytest.mark.skipif(not (control_meter.supported() and ConnectionGuard.supported()),
                    reason="needs TCP_INFO byte counts and /proc/self/fd")
def test_idle_connections_closed_at_every_sweep_do_not_delay_a_floods_cut() -> None:
    """An attacker whose silent connections reach their handshake deadline at every sweep
    (the guard closes some each time) does not hold off the byte look: the flooder is cut
    at the same look as with nothing else to close (before: never, while the idle ones
    kept coming)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        port = listener.getsockname()[1]
        meter_ = ControlMeter(2_000, floor_bytes=0)
        guard = ConnectionGuard(port, handshake_timeout_s=0.05, max_idle_per_host=100,
                                max_idle=100, max_connections=100, control=meter_)
        opened: list[socket.socket] = []

        def idle_one() -> None:  # a connection that never calls: doomed at the next sweep
            opened.append(socket.create_connection(("127.0.0.1", port)))
            opened.append(listener.accept()[0])

        flooder = socket.create_connection(("127.0.0.1", port))
        flooded, _ = listener.accept()
        opened += [flooder, flooded]
        try:
            guard.called("ipv4:127.0.0.1:%d" % flooder.getsockname()[1])  # made a call first
            idle_one()
            guard.sweep(T0)  # the first look
            flooder.sendall(b"w" * 3_000)  # bytes no call accounts for
            assert wait_for(lambda: tcp_bytes(flooded)[0] == 3_000)
            closed = []
            for step in (0.1, control_meter.LOOK_S, 2 * control_meter.LOOK_S):
                idle_one()
                closed.append(guard.sweep(T0 + step))
            assert closed == [1, 1, 2]  # an idle one each time, and the flooder at the third
            assert meter_.cut == 1
            flooder.settimeout(10)
            assert flooder.recv(1) == b""
        finally:
            guard.stop()
            for sock in opened:
                sock.close()


ATARI_INSERTS = 60  # of 7.2 MB each (two messages: a chunked insert), at most
ATARI_INSERTS_S = 4.0  # at most


@pytest.mark.skipif(not (control_meter.supported() and ConnectionGuard.supported()),
                    reason="needs TCP_INFO byte counts")
def test_an_actors_7_mb_inserts_leave_no_control_beyond_the_allowances() -> None:
    """A real server (in this process, to read its meter) and an actor inserting 256 Atari
    rows a call back to back: the 9-byte header of each 16 KiB DATA frame (about 4 KB a call)
    is allowed with the message bytes, so what the connection sent beyond its allowances, from
    a look before the inserts to one after (both with nothing on its way), stays near zero.
    With a flat allowance per message it grew by about 3.4 KB a call (the control-bytes
    benchmark's window peak: 301,509 bytes, over the default limit's 131,072), and such an
    actor's connection was cut within a minute."""
    from replay_client import ReplayClient
    from replay_server.app.embedded import EmbeddedServer
    from replay_server.engine.config import TableConfig
    from replay_server.service.settings import ServerSettings

    settings = ServerSettings(address="127.0.0.1:0",
                              tables=(TableConfig(name="atari", capacity=512),))
    frames = {"obs": torch.randint(0, 255, (256, 4, 84, 84), dtype=torch.uint8)}
    with EmbeddedServer(settings) as server, \
            ReplayClient(server.address, timeout=30, max_retry_s=0) as actor:
        meter = server._server.connections.control  # the server's own meter
        assert meter is not None
        looked: dict[tuple[str, int], tuple[int, int]] = {}
        judge = meter.over

        def over(address: tuple[str, int], received: int, sent: int, now: float) -> int:
            looked[address] = (received, sent)  # the socket's counts at the guard's look
            return judge(address, received, sent, now)

        meter.over = over  # type: ignore[method-assign]
        actor.info()  # connected, counted, and idle at the next look

        def idle_control() -> dict[tuple[str, int], int]:
            looked.clear()
            assert wait_for(lambda: looked, timeout=5)
            return {a: meter.control(a, *counts) for a, counts in looked.items()}

        before = idle_control()
        deadline = time.monotonic() + ATARI_INSERTS_S
        count = 0
        while count < ATARI_INSERTS and time.monotonic() < deadline:
            actor.insert("atari", frames)  # raises UnavailableError if the connection is cut
            count += 1
        after = idle_control()
        grown = {a: after[a] - before[a] for a in after if a in before}
        assert count >= 10 and grown
        assert meter.cut == 0 and max(grown.values()) < 200 * count, (count, grown)
