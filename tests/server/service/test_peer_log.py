"""peer_log: lines about a client are rate-limited per client host and topic."""

from __future__ import annotations

import logging
import time

from replay_server.service.peer_log import PeerLog, peer_host


def test_peers_are_keyed_by_host_without_the_port() -> None:
    assert peer_host("ipv4:10.0.0.7:53412") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:[::1]:5") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"
    assert peer_host(None) == "unknown"


def test_a_burst_per_peer_and_topic_then_a_count(caplog) -> None:
    logger = logging.getLogger("test.peer_log")
    log = PeerLog(logger, burst=3, window_s=0.2)
    with caplog.at_level(logging.INFO, logger="test.peer_log"):
        logged = [log.log("ipv4:1.2.3.4:1000", "bad", logging.INFO, "mistake %d", i)
                  for i in range(100)]
        log.log("ipv4:1.2.3.4:2000", "other", logging.INFO, "another kind")
        log.log("ipv4:5.6.7.8:1", "bad", logging.INFO, "another peer")
        time.sleep(0.25)
        log.log("ipv4:1.2.3.4:3000", "bad", logging.INFO, "after the window")
    assert logged.count(True) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:3] == ["mistake 0", "mistake 1",
                            "mistake 2 (more about this peer in the next 0 s are counted, "
                            "not logged)"]
    assert "another kind" in messages and "another peer" in messages
    assert "97 more messages about ipv4:1.2.3.4 (bad) were not logged in the last 0 s" in messages
    assert messages[-1] == "after the window"


def test_the_peers_tracked_are_bounded() -> None:
    log = PeerLog(logging.getLogger("test.peer_log.bounded"), burst=1, max_peers=10)
    for i in range(1000):
        log.log(f"ipv4:10.0.{i // 256}.{i % 256}:1", "bad", logging.ERROR, "x")
    assert log.tracked == 10


def test_clients_rotating_their_address_get_the_global_limit_then_one_count(caplog) -> None:
    logger = logging.getLogger("test.peer_log.global")
    log = PeerLog(logger, burst=5, window_s=0.3, total=20)
    with caplog.at_level(logging.INFO, logger="test.peer_log.global"):
        logged = sum(log.log(f"ipv4:127.0.{i // 250}.{i % 250 + 1}:1", "bad", logging.INFO,
                             "mistake from %s", str(i)) for i in range(2000))
        time.sleep(0.35)
        log.log("ipv4:10.9.9.9:1", "bad", logging.INFO, "after the window")
    assert logged == 20
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 22
    assert "more about any client in the next 0 s are counted" in messages[19]
    assert messages[20] == ("1980 more messages about clients were not logged in the last 0 s "
                            "(at most 20 a window)")
    assert messages[21] == "after the window"


def test_every_value_of_a_line_is_cut(caplog) -> None:
    logger = logging.getLogger("test.peer_log.cut")
    log = PeerLog(logger)
    with caplog.at_level(logging.INFO, logger="test.peer_log.cut"):
        log.log("ipv4:1.2.3.4:5", "bad", logging.INFO, "no table %s: %s", "t" * (8 << 20),
                ValueError("v" * 100_000))
    [line] = [r.getMessage() for r in caplog.records]
    assert len(line) < 3000 and "(8,388,608 characters in all)" in line
