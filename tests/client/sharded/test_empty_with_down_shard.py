"""An empty replay's sample names the shards it could not ask (issue 32, friction 6).

With the only shard that held rows down, a degraded client's sample said "nothing to
sample on any of its 3 shards", hiding that the rows may all be on the missing one. Two
real servers in this process on 127.0.0.1; shard 1 holds every row, then closes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from replay_client import ReplayClient, errors
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer


def _server(shard: int) -> EmbeddedServer:
    return EmbeddedServer(settings_from_dict({
        "server": {"address": "127.0.0.1:0", "shard": shard, "shared_memory": False},
        "tables": [{"name": "u", "capacity": 100, "sampler": "uniform"}]}))


@pytest.fixture
def replay_without_its_rows():
    """A degraded client of two shards whose shard 1, holding every row, is down."""
    servers = [_server(0), _server(1)]
    client = ReplayClient([s.address for s in servers], allow_degraded=True)
    try:
        with ReplayClient(servers[1].address) as direct:
            direct.insert("u", {"x": torch.arange(8)})
        assert client.info()["u"].size == 8
        servers[1].close(grace=0)
        yield client
    finally:
        client.close()
        for server in servers:
            server.close()


def test_a_sample_names_the_shard_that_is_down(replay_without_its_rows) -> None:
    with pytest.raises(errors.EmptyTableError,
                       match=r"on any of its 1 live shards; shard 1 down, not counted"):
        replay_without_its_rows.sample("u", 4, wait=False)


def test_a_waiting_sample_times_out_naming_the_shard_that_is_down(replay_without_its_rows):
    with pytest.raises(errors.DeadlineExceededError,
                       match=r"had nothing to sample on any of its 1 live shards within 0.2 s; "
                             r"shard 1 down"):
        replay_without_its_rows.sample("u", 4, wait=True, timeout=0.2)


def test_a_waiting_sample_takes_the_rows_a_live_shard_gets_meanwhile(replay_without_its_rows):
    client = replay_without_its_rows
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.sample, "u", 4, wait=True, timeout=60)
        client.insert("u", {"x": torch.arange(100, 108)})  # to the live shard 0
        batch = waiting.result(timeout=90)
    assert batch.data["x"].tolist() and all(100 <= x < 108 for x in batch.data["x"].tolist())
