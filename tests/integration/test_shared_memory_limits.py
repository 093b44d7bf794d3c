"""Shared-memory rings: capped by a budget, and never left behind by a kill -9.

Issue 10, finding 12: a ring was reserved at (credits + 1) x batch bytes
with no cap (prefetch 1024 reserved 1.4 GB of /dev/shm), and a server
killed between offering a ring and the learner's answer left it in
/dev/shm. Now all rings together take at most ``shared_memory_mb`` (a
stream whose ring would not fit uses gRPC and says why), and a server
removes, when it starts, the rings of servers that are gone. Real server
processes; the rings live in a directory of the test's own
(``REPLAY_SHM_DIR``) so nothing else on the host is touched.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import ServerProcess, start_server, wait_for
from tests.wire import unanswered_ring_offer

CONFIG = """
[server]
shared_memory_mb = 4

[[tables]]
name = "frames"
capacity = 200
"""


def rings(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("replay-"))


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def first(tmp_path_factory, shm_dir: Path) -> Iterator[ServerProcess]:
    """A server whose rings live in ``shm_dir`` (the second test kills it)."""
    proc = start_server(tmp_path_factory.mktemp("first"), CONFIG,
                        env={"REPLAY_SHM_DIR": str(shm_dir)})
    ReplayClient(proc.address).insert(
        "frames", {"frame": torch.zeros(200, 84, 84, dtype=torch.uint8)})
    yield proc
    proc.stop()


def test_a_ring_over_the_budget_is_refused_with_its_reason_and_grpc_serves(
    first: ServerProcess, shm_dir: Path, monkeypatch
) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm_dir))
    client = ReplayClient(first.address)
    # 16 frames of 7 KB = 113 KB a batch: a window of 64 needs a ring of 7 MiB, over 4 MiB.
    # One batch per message: the shared-memory ring carries ungrouped batches only.
    stream = client.stream("frames", 16, prefetch=64, num_batches=3, batches_per_message=1)
    assert sum(batch.data["frame"].shape == (16, 84, 84) for batch in stream) == 3
    assert stream.transport == "grpc"
    assert any("no shared-memory ring" in note and "server.shared_memory_mb" in note
               for note in stream.stats.notes), stream.stats.notes
    # A window whose ring fits takes shared memory.
    small = client.stream("frames", 16, prefetch=4, num_batches=3, batches_per_message=1)
    assert sum(1 for _ in small) == 3 and small.transport == "shared_memory"
    assert wait_for(lambda: rings(shm_dir) == [])
    # The ring's name goes when the learner answers; its bytes when the call has ended,
    # which follows the learner's last batch by the server's own turn.
    assert wait_for(lambda: client.server_info().limits["shared_memory_in_use_bytes"] == 0)


def test_a_ring_offered_by_a_server_killed_before_the_answer_is_removed_at_the_next_start(
    first: ServerProcess, shm_dir: Path, server_factory
) -> None:
    with unanswered_ring_offer(first.address, "frames", 4) as offer:
        assert rings(shm_dir) == [offer.name]
        first.stop(signal.SIGKILL)  # between the offer and the answer
    assert rings(shm_dir) == [offer.name]  # left behind by the kill ...

    second = server_factory(CONFIG, env={"REPLAY_SHM_DIR": str(shm_dir)})  # ... until the next
    assert rings(shm_dir) == []  # server on the host starts
    assert f"removed shared-memory ring {offer.name}" in second.log()
