"""A learner's open streams do not hold the server's shutdown, and come back after it.

The client keeps a CallStream open for its waiting priority updates (and one for its
small inserts), and a
learner's SampleStream waits for credit while its window is full. A server
that is told to stop (SIGTERM) ends such streams at once, instead of letting
them run out the drain's whole grace (which would push the final checkpoint
past an orchestrator's kill deadline).
"""

from __future__ import annotations

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import start_server, wait_for

CONFIG = """
[[tables]]
name = "per"
capacity = 100
sampler = "prioritized"
"""


def test_an_idle_update_stream_ends_when_the_server_drains_and_reopens_after(tmp_path) -> None:
    # A 60 s grace: a stream that held the drain would keep the server up past stop()'s 30 s.
    server = start_server(tmp_path, CONFIG, extra_args=("--grace", "60"))
    client = ReplayClient(server.address, timeout=10, max_retry_s=30)
    try:
        ids = client.insert("per", {"x": torch.zeros(4)})
        assert client.update_priorities("per", ids, torch.ones(4)) == 4
        streams = client._call_streams
        assert streams["update_priorities"]._session is not None
        assert streams["insert"]._session is not None
        assert server.stop(timeout=30) == 0  # exited by itself, well within the grace
        assert "Traceback" not in server.log()

        again = start_server(tmp_path, CONFIG, port=server.port, name="again")
        try:
            # the same client: its broken streams are replaced by new ones (the insert's ended
            # while idle, so the insert is not in doubt)
            fresh = client.insert("per", {"x": torch.zeros(2)})
            assert client.update_priorities("per", fresh, torch.full((2,), 2.0)) == 2
            assert client.info()["per"].counters["priority_updates"] == 2
        finally:
            again.stop()
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_a_stream_waiting_for_credit_ends_when_the_server_drains(tmp_path, shared_memory) -> None:
    server = start_server(tmp_path, CONFIG, extra_args=("--grace", "60"))
    client = ReplayClient(server.address, timeout=10)
    try:
        client.insert("per", {"x": torch.zeros(10)})
        stream = client.stream("per", 4, prefetch=2, batches_per_message=1,
                               shared_memory=shared_memory, reconnect=False)
        next(stream)
        # the server fills the window (the batch taken and prefetch more), then waits for credit
        assert wait_for(lambda: client.info()["per"].counters["sampled"] >= 3 * 4)
        assert server.stop(timeout=30) == 0  # exited by itself, well within the grace
        assert "Traceback" not in server.log()
        stream.close()
    finally:
        client.close()
        server.stop()
