"""How learner batches travel: shared memory vs gRPC, the automatic fallbacks, restarts.

Every case runs a real server process and the real client over 127.0.0.1.
Streams here ask for one batch per message (``batches_per_message=1``): these
small batches would otherwise be grouped over gRPC (``replay_client.grouping``).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import ServerProcess, start_server, wait_for

CONFIG = """
[[tables]]
name = "replay"
capacity = 500
sampler = "prioritized"
seed = 7

[[tables]]
name = "seq"
capacity = 500
sampler = "slice"
slice_len = 5
seed = 7
"""


def _fill(client: ReplayClient) -> dict[str, torch.Tensor]:
    """Fill both tables; the ids insert returned, per table, indexed by the ``row`` column."""
    rows = torch.arange(500)
    return {
        "replay": client.insert(
            "replay", {"row": rows, "obs": torch.randn(500, 3, 8, generator=torch.Generator().manual_seed(0))},
            priorities=(rows % 7 + 1).double()),
        "seq": client.insert(
            "seq", {"row": rows, "episode": rows // 50, "pixels": (rows % 251).to(torch.uint8).view(-1, 1).expand(500, 64).clone()}),
    }


def _fill_when_up(client: ReplayClient, timeout: float = 30.0) -> dict[str, torch.Tensor]:
    """Fill once the channel's reconnect backoff lets the restarted server be reached."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _fill(client)
        except errors.UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two servers of ``CONFIG``, shared by the module's tests that need no server of their own
    (a server's start is seconds of importing torch)."""
    tmp = tmp_path_factory.mktemp("twins")
    procs = [start_server(tmp, CONFIG, name=f"twin{n}") for n in (0, 1)]
    yield procs[0], procs[1]
    for proc in procs:
        proc.stop()


def _refill(client: ReplayClient) -> dict[str, torch.Tensor]:
    """:func:`_fill` on a shared server: both tables emptied first, and their generators
    seeded again, so that what they draw depends on nothing an earlier test did."""
    for table in ("replay", "seq"):
        client.reset(table)
    issued = _fill(client)
    for table in ("replay", "seq"):
        client.set_sampling(table, seed=7)
    return issued


def _leaked_rings(*servers):
    prefixes = tuple(f"replay-{server.process.pid}-" for server in servers)
    return [p for p in os.listdir("/dev/shm") if p.startswith(prefixes)]


@pytest.mark.parametrize("table,per_message", [("replay", 1), ("seq", 1), ("replay", 3)])
def test_shared_memory_and_grpc_deliver_identical_batches(twins, table, per_message):
    # Two servers with the same seed and contents draw the same sequence of batches.
    shm_server, grpc_server = twins
    by_shm, by_grpc = ReplayClient(shm_server.address), ReplayClient(grpc_server.address)
    issued_shm, issued_grpc = _refill(by_shm), _refill(by_grpc)
    a = by_shm.stream(table, 16, num_batches=12, shared_memory=True, batches_per_message=per_message)
    b = by_grpc.stream(table, 16, num_batches=12, shared_memory=False, batches_per_message=per_message)
    count = 0
    for x, y in zip(a, b):
        assert torch.equal(x.weights, y.weights)
        assert torch.equal(x.probabilities, y.probabilities)
        assert x.data.keys() == y.data.keys()
        for key in x.data:  # the same rows (each server issues its own ids for them)
            assert torch.equal(x.data[key], y.data[key]), key
        assert torch.equal(issued_shm[table][x.data["row"]], x.ids)
        assert torch.equal(issued_grpc[table][y.data["row"]], y.ids)
        count += 1
    assert count == 12
    assert b.transport == "grpc"
    # Grouped batches travel in gRPC messages; single ones through the ring.
    assert a.transport == ("shared_memory" if per_message == 1 else "grpc"), a.stats.notes
    assert not _leaked_rings(shm_server, grpc_server)


def test_client_without_shared_memory_uses_grpc(twins):
    client = ReplayClient(twins[0].address)
    _refill(client)
    stream = client.stream("replay", 8, num_batches=2, shared_memory=False)
    assert sum(1 for _ in stream) == 2
    assert stream.transport == "grpc"


def test_environment_switch_disables_shared_memory(twins, monkeypatch):
    client = ReplayClient(twins[0].address)
    _refill(client)
    monkeypatch.setenv("REPLAY_SHARED_MEMORY", "0")
    stream = client.stream("replay", 8, num_batches=2, batches_per_message=1)
    assert sum(1 for _ in stream) == 2
    assert stream.transport == "grpc"


def test_server_with_shared_memory_off_says_so(server_factory):
    client = ReplayClient(server_factory("[server]\nshared_memory = false\n" + CONFIG).address)
    _fill(client)
    stream = client.stream("replay", 8, num_batches=3, batches_per_message=1)
    assert sum(1 for _ in stream) == 3
    assert stream.transport == "grpc"
    assert any("shared_memory = false" in note for note in stream.stats.notes)


def test_server_that_cannot_create_a_ring_falls_back(server_factory, tmp_path):
    proc = server_factory(CONFIG, env={"REPLAY_SHM_DIR": str(tmp_path / "missing")})
    client = ReplayClient(proc.address)
    _fill(client)
    stream = client.stream("replay", 8, num_batches=3, batches_per_message=1)
    rows = [batch.ids.clone() for batch in stream]
    assert len(rows) == 3 and stream.transport == "grpc"
    assert any("could not create a shared-memory ring" in note for note in stream.stats.notes)
    assert "no shared-memory ring" in proc.log()


def test_learner_that_cannot_map_the_ring_falls_back_and_nothing_leaks(twins, monkeypatch,
                                                                        tmp_path):
    # Another container's /dev/shm: the server's ring is not visible to the learner.
    proc = twins[1]
    client = ReplayClient(proc.address)
    issued = _refill(client)["replay"]
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    stream = client.stream("replay", 8, num_batches=5, batches_per_message=1)
    assert sum(1 for batch in stream if torch.equal(issued[batch.data["row"]], batch.ids)) == 5
    assert stream.transport == "grpc"
    assert any("could not map" in note for note in stream.stats.notes)
    assert not _leaked_rings(proc)


def test_learner_on_another_host_is_not_offered_a_ring(twins, monkeypatch):
    import replay_client.ring_source as stream_module

    client = ReplayClient(twins[0].address)
    _refill(client)
    monkeypatch.setattr(stream_module, "host_id", lambda: "another-machine")
    stream = client.stream("replay", 8, num_batches=2, batches_per_message=1)
    assert sum(1 for _ in stream) == 2
    assert stream.transport == "grpc"
    assert any("another host" in note for note in stream.stats.notes)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_stream_resumes_after_a_server_restart(server_factory, shared_memory):
    """With the default reconnect window: a restart (a new process importing torch: seconds)
    takes longer than the client's max_retry_s, which a stream waited for before."""
    port = _free_port()
    client = ReplayClient(f"127.0.0.1:{port}", max_retry_s=0.5)
    first = server_factory(CONFIG, port=port)
    issued_first = _fill(client)["replay"]
    stream = client.stream("replay", 8, shared_memory=shared_memory, batches_per_message=1)
    with stream:
        for _ in range(3):
            batch = next(stream)
        # The window fills: the learner holds prefetch batches when the server dies.
        assert wait_for(lambda: client.info()["replay"].counters["sampled"] >= (3 + 2) * 8)
        first.stop(signal.SIGKILL)
        restarted: dict = {}

        def restart() -> None:  # slower than max_retry_s, while the learner waits for batches
            time.sleep(1.5)
            restarted["server"] = server_factory(CONFIG, port=port)
            restarted["issued"] = _fill_when_up(ReplayClient(restarted["server"].address))[
                "replay"]  # the new server's actor

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        got = []
        for _ in range(5):
            batch = next(stream)
            got.append((batch.data["row"].clone(), batch.ids.clone()))
        thread.join(timeout=120)
        second, issued = restarted["server"], restarted["issued"]
        # The batches the learner held come from the first server, the rest from the second.
        by_server = [next(n for n, ids in enumerate((issued_first, issued))
                          if torch.equal(ids[rows], batch_ids)) for rows, batch_ids in got]
        assert by_server == sorted(by_server) and by_server.count(1) >= 3
        assert stream.stats.reconnects == 1
        assert stream.transport == ("shared_memory" if shared_memory else "grpc")
    second.stop()


def test_stream_without_reconnect_fails_loudly(server_factory):
    proc = server_factory(CONFIG)
    client = ReplayClient(proc.address)
    _fill(client)
    stream = client.stream("replay", 8, reconnect=False, batches_per_message=1)
    next(stream)
    proc.stop(signal.SIGKILL)
    with pytest.raises(errors.UnavailableError, match=proc.address):
        for _ in range(10):
            next(stream)


def test_stream_gives_up_after_reconnect_s_naming_it(server_factory):
    proc = server_factory(CONFIG)
    client = ReplayClient(proc.address, max_retry_s=1.0)
    _fill(client)
    stream = client.stream("replay", 8, batches_per_message=1, reconnect_s=1.5)
    next(stream)
    proc.stop(signal.SIGKILL)
    with pytest.raises(errors.UnavailableError, match="not back within 1.5 s .*reconnect_s=..."):
        for _ in range(10):
            next(stream)
