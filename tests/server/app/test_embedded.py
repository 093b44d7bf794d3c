"""Embedded mode: the server in the learner's process; actors over gRPC, sampling without sockets."""

from __future__ import annotations

import threading

import pytest
import torch

from replay_client import ReplayClient
from replay_server.app.embedded import EmbeddedServer
from replay_server.errors import ConfigError, InvalidArgumentError, UnknownTableError
from replay_server.app.config_file import settings_from_dict
from tests.conftest import wait_for
from tests.wire import unanswered_ring_offer

SETTINGS = {
    "server": {"address": "127.0.0.1:0"},
    "tables": [{"name": "replay", "capacity": 1000, "sampler": "prioritized", "seed": 1},
               {"name": "seq", "capacity": 1000, "sampler": "slice", "slice_len": 4}],
}


def _replay_threads() -> set[threading.Thread]:
    """The replay's threads alive now, but the process-wide copy pools of the engine and the
    feed (replay-split, replay-feed-copy), which live on by design."""
    return {t for t in threading.enumerate() if t.name.startswith("replay-")
            and not t.name.startswith(("replay-split", "replay-feed-copy"))}


def test_actors_insert_over_grpc_and_the_learner_samples_in_process():
    # Threads an earlier test in this process left winding down (a sharded client's pool ends
    # its threads after close) are not this server's.
    earlier = _replay_threads()
    with EmbeddedServer(settings_from_dict(SETTINGS)) as server:
        actor = ReplayClient(server.address)
        ids = actor.insert("replay", {"row": torch.arange(300), "obs": torch.randn(300, 4)})
        stream = server.stream("replay", 32, num_batches=20)
        count = 0
        for batch in stream:
            assert torch.equal(ids[batch.data["row"]], batch.ids)
            count += 1
        assert count == 20 and stream.transport == "in_process"
        # The learner's priority updates go straight to the table, too.
        assert server.tables["replay"].update_priorities(batch.ids, torch.full((32,), 5.0)) == 32
        actor.close()
    # The stream's and the server's threads are gone.
    assert not _replay_threads() - earlier


def test_slices_and_a_transform_in_process():
    with EmbeddedServer(settings_from_dict(SETTINGS), listen=False) as server:
        assert server.address is None
        steps = torch.arange(400)
        server.tables["seq"].insert({"row": steps, "episode": steps // 40})

        def transform(batch):
            return {"row": batch.data["row"], "episode": batch.data["episode"]}

        for out in server.stream("seq", 8, num_batches=5, transform=transform):
            assert out["row"].shape == (8, 4)
            assert bool((out["episode"] == out["episode"][:, :1]).all())
            assert bool((out["row"][:, 1:] - out["row"][:, :-1] == 1).all())


def test_embedded_errors_are_typed():
    with EmbeddedServer(settings_from_dict(SETTINGS), listen=False) as server:
        with pytest.raises(UnknownTableError):
            server.stream("nope", 8)
        with pytest.raises(InvalidArgumentError, match="batch_size"):
            server.stream("replay", 0)
        if not torch.cuda.is_available():
            with pytest.raises(InvalidArgumentError, match="pin_memory=True needs an accelerator"):
                server.stream("replay", 8, pin_memory=True)


def test_the_embedded_server_runs_on_the_loop_its_log_names():
    # A Ray shard is an embedded server: it serves on uvloop, as a standalone server does
    # (it ran asyncio's own loop while its start-up line said uvloop).
    uvloop = pytest.importorskip("uvloop")
    with EmbeddedServer(settings_from_dict(SETTINGS)) as server:
        assert isinstance(server._loop, uvloop.Loop)  # noqa: SLF001
        client = ReplayClient(server.address)
        ids = client.insert("replay", {"row": torch.arange(3), "obs": torch.randn(3, 4)})
        assert ids.numel() == 3
        client.close()


def test_an_address_in_use_is_a_config_error():
    with EmbeddedServer(settings_from_dict(SETTINGS)) as first:
        taken = dict(SETTINGS, server={"address": first.address})
        with pytest.raises(ConfigError, match="cannot listen"):
            EmbeddedServer(settings_from_dict(taken))


def test_in_process_stream_waits_for_the_rate_limiter():
    settings = settings_from_dict({"server": {"address": "127.0.0.1:0"}, "tables": [
        {"name": "limited", "capacity": 1000, "min_size_to_sample": 100}]})
    with EmbeddedServer(settings, listen=False) as server:
        table = server.tables["limited"]
        table.insert({"row": torch.arange(50)})
        stream = server.stream("limited", 8, num_batches=2)

        def fill_later():
            assert wait_for(lambda: table.changes.waiters == 1)  # the stream waits on the table
            table.insert({"row": torch.arange(50, 150)})

        filler = threading.Thread(target=fill_later)
        filler.start()
        batches = [batch.ids.clone() for batch in stream]  # blocks until the table holds 100 rows
        filler.join()
        assert len(batches) == 2 and table.info().size == 150


def test_closing_ends_the_calls_still_open_and_removes_a_ring_offered_but_never_answered(
        tmp_path, monkeypatch):
    """A stream still open when the server closes ends in the drain (gRPC's own stop does
    not cancel it), and a shared-memory ring it offered, whose answer never came, is gone
    from /dev/shm when ``close`` returns (a Ray shard actor is killed right after)."""
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    server = EmbeddedServer(settings_from_dict(SETTINGS))
    with ReplayClient(server.address) as actor:
        actor.insert("replay", {"obs": torch.zeros(100, 64)})
    with unanswered_ring_offer(server.address, "replay", 4) as offer:
        assert [p.name for p in tmp_path.iterdir()] == [offer.name]
        server.close(grace=0.2)
        assert list(tmp_path.iterdir()) == []  # unlinked by the call's end, within close
