"""A scale down's hand-over (``replay_server.ray.handover``) between real embedded servers,
without Ray: a hand-over that a staying shard refuses part-way leaves every row stored once
(the removed shard serves again with the rows that did not move), and one asked again once
the cause is gone moves the rest, each row exactly once.

The removed shard (index 2) holds 30 episodes of 10 steps in a uniform, a prioritized and
a slice table (``key``: a per-row unique column). Shard 1's slice table was given another
schema first (``key`` float32), so it refuses the slice rows placed on it: the uniform and
prioritized rows move, and of the slice table's first chunk only shard 0's part does (an
acknowledged part that is not a prefix of the rows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from replay_client import ReplayClient
from replay_client.errors import SchemaMismatchError
from replay_server.app.config_file import settings_from_dict
from replay_server.app.embedded import EmbeddedServer
from replay_proto.id_layout import incarnation_of
from replay_server.ray.handover import (
    HandOverError,
    hand_over,
    keep_unmoved,
    retire_folder,
    unretire_folder,
)

TABLES = [{"name": "u", "capacity": 1000, "sampler": "uniform"},
          {"name": "p", "capacity": 1000, "sampler": "prioritized", "alpha": 1.0},
          {"name": "s", "capacity": 1000, "sampler": "slice", "slice_len": 2}]
EPISODES, STEPS, CHUNK = 30, 10, 50
KEYS = set(range(EPISODES * STEPS))


def _server(shard: int, folder: Path | None = None) -> EmbeddedServer:
    server = {"address": "127.0.0.1:0", "shard": shard, "shared_memory": False}
    if folder is not None:
        server["checkpoint_dir"] = str(folder)
    return EmbeddedServer(settings_from_dict({"server": server, "tables": TABLES}))


def _fill(server: EmbeddedServer) -> None:
    for episode in range(EPISODES):
        keys = torch.arange(episode * STEPS, (episode + 1) * STEPS)
        rows = {"key": keys, "episode": torch.full((STEPS,), episode),
                "done": keys % STEPS == STEPS - 1}
        server.tables["u"].insert({"key": keys})
        server.tables["p"].insert(rows, priorities=1.0 + (keys % 7).double())
        server.tables["s"].insert(rows)


def _rows(server: EmbeddedServer, table: str) -> tuple[list[int], list[float] | None]:
    """The keys of ``table``'s live int64 rows (oldest first), and their priorities."""
    stored = server.tables[table]
    if stored.size == 0:
        return [], []
    read = stored.read_rows(positions=stored.live_positions(), priorities=table == "p")
    if read.columns["key"].dtype != torch.int64:
        return [], []  # shard 1's own rows of another schema
    return read.columns["key"].tolist(), (None if read.priorities is None
                                          else read.priorities.tolist())


def _everywhere(servers: list[EmbeddedServer], table: str) -> list[int]:
    return sorted(k for server in servers for k in _rows(server, table)[0])


@pytest.fixture()
def shards(tmp_path):
    removed, staying = _server(2, tmp_path / "shard-2"), [_server(0), _server(1)]
    clients = [ReplayClient(s.address) for s in staying]
    clients[1].insert("s", {"key": torch.zeros(3, dtype=torch.float32),
                            "episode": torch.zeros(3, dtype=torch.int64),
                            "done": torch.zeros(3, dtype=torch.bool)})
    _fill(removed)
    removed.close()  # stopped: the final checkpoint holds every row
    yield removed, staying, clients
    for client in clients:
        client.close()
    for server in staying:
        server.close()


def test_a_refused_hand_over_leaves_each_row_once_and_a_retry_moves_the_rest(
        shards) -> None:
    removed, staying, clients = shards
    with pytest.raises(HandOverError, match=r"shard 1 refused rows of table 's'") as caught:
        hand_over(removed.tables, clients, chunk_rows=CHUNK)
    failure = caught.value
    assert failure.shard == 1 and isinstance(failure.__cause__, SchemaMismatchError)
    moved = {name: positions.size for name, positions in failure.moved.items()}
    assert moved["u"] == moved["p"] == len(KEYS) and 0 < moved["s"] < CHUNK  # shard 0's part

    again = EmbeddedServer(removed.settings)  # restores the final checkpoint: every row
    try:
        left = keep_unmoved(removed.tables, again.tables, failure.moved)
        assert left == {"u": 0, "p": 0, "s": len(KEYS) - moved["s"]}
        everyone = [again, *staying]
        for table in ("u", "p", "s"):  # every row once, none lost, none twice
            assert _everywhere(everyone, table) == sorted(KEYS), table
        for server in staying:  # priorities moved with their rows
            keys, priorities = _rows(server, "p")
            assert priorities == [1.0 + k % 7 for k in keys]
        kept, _ = _rows(again, "s")
        assert kept == [k for k in range(len(KEYS)) if k not in set(_rows(staying[0], "s")[0])]
        with ReplayClient(again.address) as client:  # it serves what it kept
            assert set(client.sample("s", 16).columns["key"][:, 0].tolist()) <= set(kept)
            client.checkpoint()  # as the shard does once it serves again
        again.close()  # restored from its checkpoints: the kept rows, no moved one
        again = EmbeddedServer(removed.settings)
        assert _rows(again, "s")[0] == kept and again.tables["u"].size == 0
        assert again.tables["p"].size == 0

        clients[1].reset("s", schema=True)  # the cause removed: a retry moves the rest
        assert hand_over(again.tables, clients, chunk_rows=CHUNK) == {
            "u": 0, "p": 0, "s": len(kept)}
    finally:
        again.close()
    for table in ("u", "p", "s"):
        assert _everywhere(staying, table) == sorted(KEYS), table
    for server in staying:  # each episode whole, in order, on one shard
        keys, _ = _rows(server, "s")
        by_episode: dict[int, list[int]] = {}
        for key in keys:
            by_episode.setdefault(key // STEPS, []).append(key)
        assert all(steps == list(range(e * STEPS, (e + 1) * STEPS))
                   for e, steps in by_episode.items())


def test_rows_not_moved_come_back_without_a_checkpoint_folder(tmp_path) -> None:
    removed = _server(2)
    _fill(removed)
    removed.close()
    moved = {"u": np.empty(0, np.int64), "p": removed.tables["p"].live_positions()[:25],
             "s": np.empty(0, np.int64)}
    again = _server(2)  # no checkpoint: it starts empty
    try:
        assert keep_unmoved(removed.tables, again.tables, moved) == {
            "u": len(KEYS), "p": len(KEYS) - 25, "s": len(KEYS)}
        keys, priorities = _rows(again, "p")
        assert keys == list(range(25, len(KEYS)))
        assert priorities == [1.0 + k % 7 for k in keys]
        assert _rows(again, "u")[0] == _rows(again, "s")[0] == list(range(len(KEYS)))
    finally:
        again.close()


def test_a_staying_shard_gone_between_chunks_keeps_the_rows_it_did_not_take(tmp_path) -> None:
    """Shard 1 stops before the hand-over: the uniform table's chunks take turns, so its
    first chunk moves to shard 0 and the second finds shard 1 gone (refused within the
    client's timeout, which only bounds the call)."""
    removed, staying = _server(2, tmp_path / "shard-2"), [_server(0), _server(1)]
    _fill(removed)
    removed.close()
    clients = [ReplayClient(s.address, timeout=5) for s in staying]
    staying[1].close()
    try:
        with pytest.raises(HandOverError, match=r"shard 1 refused rows of table 'u' \(50 "
                                                r"rows had moved\): UnavailableError") as caught:
            hand_over(removed.tables, clients, chunk_rows=CHUNK)
        again = EmbeddedServer(removed.settings)
        try:
            assert keep_unmoved(removed.tables, again.tables, caught.value.moved) == {
                "u": len(KEYS) - CHUNK, "p": len(KEYS), "s": len(KEYS)}
            assert _rows(staying[0], "u")[0] == list(range(CHUNK))
            assert _rows(again, "u")[0] == list(range(CHUNK, len(KEYS)))
            for table in ("p", "s"):  # untouched: as restored, the same ids
                assert _rows(again, table)[0] == list(range(len(KEYS)))
                assert (again.tables[table].read_rows(positions=np.arange(len(KEYS))).ids
                        == removed.tables[table].read_rows(positions=np.arange(len(KEYS))).ids
                        ).all()
        finally:
            again.close()
    finally:
        for client in clients:
            client.close()
        staying[0].close()


def test_a_shard_started_again_after_its_index_retired_issues_none_of_its_ids(tmp_path) -> None:
    """A scale down sets the removed shard's folder aside; a later scale up starts a shard of
    that index on the same path. It begins empty, and its ids carry later incarnations than
    the removed shard's (the id counter stays at the path): an update naming an id of a
    row that moved (a learner's batch drawn before the scale) names no row of the new shard.
    Before, the new shard counted incarnations from 1 again and reissued the same ids."""
    folder = tmp_path / "shard-2"
    removed = _server(2, folder)
    with ReplayClient(removed.address) as client:
        old = client.insert("p", {"key": torch.arange(5)})
    removed.close()
    unretire_folder(retire_folder(folder), folder)  # a failed scale puts the folder back
    back = _server(2, folder)
    assert back.tables["p"].size == 5  # ... and its rows come back with it
    back.close()
    retire_folder(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["INCARNATION"]
    started = _server(2, folder)
    try:
        assert all(started.tables[t["name"]].size == 0 for t in TABLES)  # begins empty
        with ReplayClient(started.address) as client:
            new = client.insert("p", {"key": torch.arange(5)})
            assert set(old.tolist()).isdisjoint(new.tolist())
            assert incarnation_of(int(new[0])) > incarnation_of(int(old[-1]))
            assert client.update_priorities("p", old, torch.full((5,), 9.0)) == 0  # stale
    finally:
        started.close()
