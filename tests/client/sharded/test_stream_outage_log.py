"""A degraded learner's stream logs a shard's outage once, however many times it tries it.

A shard that restarts for seconds is tried again on a backoff; each try used
to reconnect, and log "lost ... reconnecting", again (nine lines in one Ray
shard restart). Now a try fails at once until the shard answers: one warning
when it is left out, one line when it is back. Two real servers in this
process on 127.0.0.1; shard 1 is closed, then served again on its port.
"""

from __future__ import annotations

import logging
import time

import torch

from replay_client import ReplayClient
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer

TRIES = 4  # probes of the closed shard the test waits for


def _server(shard: int, port: int = 0) -> EmbeddedServer:
    return EmbeddedServer(settings_from_dict({
        "server": {"address": f"127.0.0.1:{port}", "shard": shard, "shared_memory": False},
        "tables": [{"name": "u", "capacity": 1000, "sampler": "uniform"}]}))


def _about(records: list[logging.LogRecord], address: str, level: int) -> list[str]:
    return [r.getMessage() for r in records
            if r.levelno >= level and address in r.getMessage()]


def test_an_outage_is_one_warning_and_one_line_when_the_shard_is_back(caplog) -> None:
    servers = [_server(0), _server(1)]
    address = servers[1].address
    port = int(address.rsplit(":", 1)[1])
    client = ReplayClient([s.address for s in servers], allow_degraded=True)
    stream = None
    try:
        for start in range(0, 64, 8):
            client.insert("u", {"key": torch.arange(start, start + 8)})
        caplog.set_level(logging.INFO)
        stream = client.stream("u", 8)
        assert next(stream).missing_shards == ()
        servers[1].close(grace=0)
        deadline = time.monotonic() + 60
        while client.shard_stats().failures < TRIES:  # the stream tries shard 1 again and again
            assert time.monotonic() < deadline, client.shard_stats()
            batch = next(stream)
            time.sleep(0.02)
        assert batch.missing_shards == (1,)
        warnings = _about(caplog.records, address, logging.WARNING)
        assert len([w for w in warnings if "left out of the stream" in w]) == 1, warnings
        assert len(warnings) <= 2, warnings  # and at most the first loss's "reconnecting"

        servers[1] = _server(1, port)  # back on its address, with rows (as from a checkpoint)
        with ReplayClient(address) as direct:
            direct.insert("u", {"key": torch.arange(100, 108)})
        while True:
            assert time.monotonic() < deadline, client.shard_stats()
            batch = next(stream)
            if batch.missing_shards == () and 1 in set((batch.ids >> 56).tolist()):
                break
            time.sleep(0.02)
        back = [m for m in _about(caplog.records, address, logging.INFO) if "is back" in m]
        assert len(back) == 1, back
        assert len(_about(caplog.records, address, logging.WARNING)) == len(warnings)
    finally:
        if stream is not None:
            stream.close()
        client.close()
        for server in servers:
            server.close()
