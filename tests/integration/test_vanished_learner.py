"""A learner whose host vanishes gives its leased rows back within the server's keepalive:
real servers, real clients, the test proxy (``tests/tools/proxy.py``) between them on loopback.

When a learner's host loses power or is cut off by a partition, its connection sends
nothing more, not even a FIN or an RST. Before HTTP/2 keepalive the server only noticed
when TCP gave up on the connection (about 15 minutes of retransmissions, forever through a
proxy that keeps its sockets open), and the rows the learner's stream held stayed leased
all that time. Now the server pings every connection every ``keepalive_s`` and closes one
whose ping is not answered within ``keepalive_timeout_s``, ending its calls: the stream's
unfinished batches go back to the queue (``docs/service.md``, "Delivery").

The proxy plays the partition: ``stall()`` stops every byte both ways while both sockets
stay open.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient
from tests.conftest import ServerProcess, start_server, wait_for
from tests.tools.proxy import LinkProxy

BATCH = 10
ROWS = 200
DEADLINE_S = 60.0
"""Generous: with a 1 s keepalive and a 1 s timeout the rows are back in about 2 s."""

CONFIG = """
[server]
keepalive_s = 1
keepalive_timeout_s = 1

[[tables]]
name = "queue"
capacity = 10000
sampler = "fifo"
lease_timeout_s = 1
"""

LEARNER = textwrap.dedent("""
    import sys, time
    from replay_client import ReplayClient
    client = ReplayClient(sys.argv[1], timeout=30)
    stream = client.stream("queue", %d, prefetch=4)
    for taken, batch in enumerate(stream, 1):
        print(" ".join(map(str, batch.data["x"].tolist())), flush=True)
        if taken == 3:
            print("holding", flush=True)
            time.sleep(600)  # its host vanishes here: holding this batch, more prefetched
""" % BATCH)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path, CONFIG)
    yield proc
    proc.stop()


def test_a_vanished_learners_stream_gives_its_rows_back(server) -> None:
    with ReplayClient(server.address, timeout=30) as client, \
            LinkProxy(server.address) as proxy:
        client.insert("queue", {"x": torch.arange(ROWS)})
        learner = subprocess.Popen([sys.executable, "-c", LEARNER, proxy.address],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert learner.stdout is not None
            batches = []
            for line in learner.stdout:
                if line.startswith("holding"):
                    break
                batches.append([int(x) for x in line.split()])
            assert len(batches) == 3, learner.stderr.read() if learner.stderr else ""
            # The positive event: the server drew past the batch held (prefetched batches).
            assert wait_for(lambda: client.info()["queue"].counters["sampled"] > 3 * BATCH)
            proxy.stall()  # the learner's host vanishes: no byte either way, no FIN, no RST
            finished = [x for batch in batches[:-1] for x in batch]
            left = ROWS - len(finished)
            back = wait_for(lambda: client.info()["queue"].size == left, timeout=DEADLINE_S)
            queue = client.info()["queue"]
            assert back, (f"the vanished learner's rows stayed leased: {queue}\nserver log "
                          f"(end):\n{server.log()[-3000:]}")
            assert queue.counters["returned"] >= 2 * BATCH  # the batch held + those prefetched
            # A second learner gets them: the batch the vanished one held first (fifo).
            again: list[int] = []
            with client.stream("queue", BATCH, num_batches=left // BATCH) as stream:
                for batch in stream:
                    again += batch.data["x"].tolist()
        finally:
            learner.send_signal(signal.SIGKILL)
            learner.wait(timeout=30)
    assert again[:BATCH] == batches[-1]
    assert sorted(finished + again) == list(range(ROWS)), "a row was lost or handed out twice"


def test_a_vanished_clients_unary_lease_expires(server) -> None:
    with ReplayClient(server.address, timeout=30) as client, \
            LinkProxy(server.address) as proxy:
        client.insert("queue", {"x": torch.arange(ROWS)})
        with ReplayClient(proxy.address, timeout=30) as gone:
            taken = gone.sample("queue", BATCH).data["x"].tolist()  # leased, never acknowledged
            proxy.stall()  # its host vanishes
            back = wait_for(lambda: client.info()["queue"].counters["returned"] >= BATCH,
                            timeout=DEADLINE_S)
            assert back, f"the vanished client's lease never expired: {client.info()['queue']}"
            again = client.sample("queue", BATCH).data["x"].tolist()
    assert again == taken == list(range(BATCH))
