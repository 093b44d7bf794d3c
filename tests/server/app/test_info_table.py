"""replay_server.app.info_table: human units for people, exact JSON for scripts."""

from __future__ import annotations

import json

import pytest

from replay_proto.v1 import replay_pb2 as pb
from replay_server.app.info_table import count, duration, format_info, info_json, nbytes


@pytest.mark.parametrize(("n", "text"), [
    (0, "0"), (999, "999"), (1000, "1k"), (1234, "1.23k"), (12_345, "12.3k"), (100_000, "100k"),
    (999_999, "1M"), (1_500_000, "1.5M"), (346_000_000, "346M"), (2_000_000_000, "2G"),
])
def test_counts_read_in_three_significant_figures(n: int, text: str) -> None:
    assert count(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (800_000, "781 KiB"),
    (27_682_406, "26.4 MiB"), (3 * 2**30 // 2, "1.5 GiB"), (5 * 2**40, "5 TiB"),
])
def test_bytes_read_in_binary_units(n: int, text: str) -> None:
    assert nbytes(n) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (42.9, "42s"), (303, "5m 03s"), (3 * 3600 + 7 * 60, "3h 07m"), (2 * 86400 + 4 * 3600, "2d 04h"),
])
def test_durations_read_in_two_units(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def _response() -> pb.InfoResponse:
    return pb.InfoResponse(
        tables=[pb.TableInfo(name="atari", sampler="prioritized", capacity=1_000_000,
                             size=250_000, storage_bytes=28_224_000_000,
                             counters=pb.TableCounters(inserted=3_000_000_000, sampled=12),
                             rate_limiter=pb.RateLimiterInfo(max_diff=float("inf")))],
        server=pb.ServerInfo(version="9.9", rss_bytes=30 * 2**30, uptime_seconds=7300, tls=True,
                             auth=True, checkpoint_dir="/data/ckpt"))


def test_the_table_shows_memory_and_the_server_line() -> None:
    lines = format_info(_response()).splitlines()
    assert lines[0] == ("replay-server 9.9, up 2h 01m; memory 30 GiB resident, tables 26.3 GiB; "
                        "TLS, token; checkpoints in /data/ckpt")
    assert lines[3].split() == ["atari", "prioritized", "250k", "1M", "25.0%", "26.3", "GiB",
                                "3G", "12", "0", "0", "no"]


def test_json_keeps_every_figure_exact() -> None:
    info = json.loads(info_json(_response()))
    [table] = info["tables"]
    assert table["storage_bytes"] == 28_224_000_000 and table["counters"]["inserted"] == 3 * 10**9
    assert table["rate_limiter"]["max_diff"] == "inf"
    assert info["server"]["uptime_seconds"] == 7300 and info["last_checkpoint"] is None
