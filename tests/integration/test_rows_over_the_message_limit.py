"""Rows larger than a message: inserted in chunks, refused by every sample with one clear error.

Issue 34, item 10: a table whose rows are over 4 MiB (the message limit)
could not be streamed, and said so badly: the server encoded a batch into a
message gRPC would not send, answered INTERNAL, logged an ERROR traceback for
each of the learner's tries and leaked the group's memory (item 1). Now a
row over the limit goes in as a chunked insert, and a ``Sample``,
``SampleChunks`` or ``SampleStream`` of it is refused before anything is
drawn (RESOURCE_EXHAUSTED, kind ``limit_exceeded``: ``LimitExceededError``
naming ``max_message_mb``), once, with nothing logged at ERROR and nothing
left reserved. Those are the gRPC paths a client on another host takes (the
module's clients run with ``REPLAY_SHARED_MEMORY=0``); on the server's host a
sample goes through the client's shared-memory region, where no message limit
applies.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, grpc_calls_only, module_server, wait_for

ROW_FLOATS = 5 << 18  # 5 MiB a row, over the 4 MiB message limit
ROWS = 4

CONFIG = f"""
[server]
memory_budget_mb = 256
max_batch_mb = 64

[[tables]]
name = "huge"
capacity = {ROWS}
"""

server = module_server(CONFIG)


def _rows() -> torch.Tensor:
    """Row ``k`` holds ``k * ROW_FLOATS ...``: a sampled row says which it is."""
    return torch.arange(ROWS * ROW_FLOATS, dtype=torch.float32).reshape(ROWS, ROW_FLOATS)

_grpc = grpc_calls_only()  # samples as Sample calls, as from another host


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as c:
        yield c


def test_rows_over_the_message_limit_are_inserted_in_chunks(client: ReplayClient) -> None:
    client.insert("huge", {"obs": _rows()})
    assert client.info()["huge"].size == ROWS


def test_a_stream_of_rows_over_the_message_limit_is_refused_once_naming_the_limit(
        client: ReplayClient, server: ServerProcess) -> None:
    idle = client.server_info().limits["memory_in_use_bytes"]
    with pytest.raises(errors.LimitExceededError, match="max_message_mb"):
        for _ in client.stream("huge", batch_size=1, num_batches=2):
            pass
    with pytest.raises(errors.LimitExceededError, match="max_message_mb"):
        client.sample("huge", 1)
    assert wait_for(lambda: client.server_info().limits["memory_in_use_bytes"] == idle)
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert client.info()["huge"].size == ROWS  # nothing lost


def test_on_the_servers_host_such_rows_are_sampled_through_the_region(
        client: ReplayClient, server: ServerProcess, monkeypatch) -> None:
    monkeypatch.setenv("REPLAY_SHARED_MEMORY", "1")
    with ReplayClient(server.address, timeout=30) as local:
        batch = local.sample("huge", 2)
    assert batch.columns["obs"].shape == (2, ROW_FLOATS)
    rows = _rows()
    for row in batch.columns["obs"]:
        assert torch.equal(row, rows[int(row[0]) // ROW_FLOATS])
    with pytest.raises(errors.MessageTooLargeError, match="one row is over it"):
        client.read("huge", ids=batch.ids[:1])  # a read is a gRPC answer wherever it runs
