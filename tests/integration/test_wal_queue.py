"""With the write-ahead log a queue's acknowledged takes survive ``kill -9`` (docs/durability.md,
"Queue takes and acknowledgements"): real server processes, the real client.

Without the log (tests/integration/test_queue_delivery.py) every row taken after the last
checkpoint comes back after a crash, acknowledged or not; with it only the rows whose lease
was never acknowledged do.
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import torch
from replay_client import ReplayClient
from replay_proto.sample_codec import decode_sample
from replay_proto.v1 import replay_pb2 as pb

from tests.conftest import start_server
from tests.integration.test_queue_delivery import drain


def _config(directory: Path) -> str:
    return f"""
[server]
checkpoint_dir = "{directory}"
checkpoint_interval_s = 0
wal = true
wal_sync = "os"

[[tables]]
name = "queue"
capacity = 10000
sampler = "fifo"
lease_timeout_s = 60
"""


def test_kill_9_redelivers_only_the_rows_never_acknowledged(tmp_path) -> None:
    cfg = _config(tmp_path / "checkpoints")
    server = start_server(tmp_path, cfg)
    with ReplayClient(server.address, timeout=30) as a, \
            ReplayClient(server.address, timeout=30) as b, \
            ReplayClient(server.address, timeout=30) as c:
        a.insert("queue", {"x": torch.arange(100)})
        acked = [x for _ in range(3) for x in a.sample("queue", 10).data["x"].tolist()]
        a.ack("queue")                                       # rows 0-29: acknowledged
        leased = b.sample("queue", 20).data["x"].tolist()   # rows 30-49: never acknowledged
        a.checkpoint()
        after = a.sample("queue", 10).data["x"].tolist()     # rows 50-59: after the checkpoint,
        acked_after = after + a.sample("queue", 5).data["x"].tolist()  # 60-64 too: the second
        a.ack("queue")                                       # sample acknowledged the first
        leased_after = c.sample("queue", 10).data["x"].tolist()  # 65-74: never acknowledged
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    server = start_server(tmp_path, cfg, name="restarted")
    try:
        with ReplayClient(server.address, timeout=30) as d:
            again = drain(d, batch=10)
    finally:
        server.stop()
    assert acked_after == list(range(50, 65)) and leased_after == list(range(65, 75))
    assert sorted(again) == [*range(30, 50), *range(65, 100)], again
    assert not (set(acked) | set(acked_after)) & set(again)
    assert set(leased) | set(leased_after) <= set(again)


def test_a_take_without_a_lease_is_logged_when_drawn(tmp_path) -> None:
    """An old client that names no lease takes rows for good: after kill -9 they stay taken."""
    cfg = _config(tmp_path / "checkpoints")
    server = start_server(tmp_path, cfg)
    with ReplayClient(server.address, timeout=30) as client:
        client.insert("queue", {"x": torch.arange(10)})
        with grpc.insecure_channel(server.address) as channel:
            sample = channel.unary_unary("/replay.v1.ReplayService/Sample")
            request = pb.SampleRequest(table="queue", batch_size=4).SerializeToString()
            taken = decode_sample(sample(request, timeout=30)).data["x"].tolist()
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    server = start_server(tmp_path, cfg, name="restarted")
    try:
        with ReplayClient(server.address, timeout=30) as client:
            assert client.info()["queue"].size == 6
            again = drain(client, batch=10)
    finally:
        server.stop()
    assert taken == [0, 1, 2, 3] and again == [4, 5, 6, 7, 8, 9]
