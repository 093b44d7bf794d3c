"""Rows larger than a message: inserted in chunks, refused by every sample with one clear error.

Issue 34, item 10: a table whose rows are over 4 MiB (the message limit)
could not be streamed, and said so badly: the server encoded a batch into a
message gRPC would not send, answered INTERNAL, logged an ERROR traceback for
each of the learner's tries and leaked the group's memory (item 1). Now a
row over the limit goes in as a chunked insert, and a ``Sample``,
``SampleChunks`` or ``SampleStream`` of it is refused before anything is
drawn (RESOURCE_EXHAUSTED, kind ``limit_exceeded``: ``LimitExceededError``
naming ``max_message_mb``), once, with nothing logged at ERROR and nothing
left reserved.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, module_server, wait_for

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


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=30, max_retry_s=0) as c:
        yield c


def test_rows_over_the_message_limit_are_inserted_in_chunks(client: ReplayClient) -> None:
    rows = torch.randn(ROWS, ROW_FLOATS)
    client.insert("huge", {"obs": rows})
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
