"""Row ids are never issued twice, not even across a crash: real server processes, kill -9.

Issue 10, finding 1: ids acknowledged after the last checkpoint used to be
issued again after a crash and restore, so a learner's late priority update
was applied to a different, newer row (and right after the restart it
raised "never issued", which killed learners). Ids now carry the server's
shard and an incarnation taken durably from ``checkpoint_dir/INCARNATION``
before the server serves (see ``replay_server.engine.id_space``).
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from replay_client import ReplayClient
from tests.conftest import start_server

CONFIG = """
[server]
checkpoint_dir = "{directory}"
checkpoint_interval_s = 0
shard = 3

[[tables]]
name = "replay"
capacity = 1000
sampler = "prioritized"
"""


def rows(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    tags = torch.arange(start, start + n)
    return {"obs": tags.float().unsqueeze(1), "tag": tags}


def stale_updates(client: ReplayClient) -> int:
    return client.info()["replay"].counters["stale_priority_updates"]


def test_ids_issued_before_a_crash_are_never_issued_again(tmp_path: Path) -> None:
    text = CONFIG.format(directory=tmp_path / "ckpt")
    # A run that crashes before its first checkpoint has used up its ids all the same.
    first = start_server(tmp_path, text, name="first")
    crashed = ReplayClient(first.address).insert("replay", rows(10))
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert not list((tmp_path / "ckpt").glob("ckpt-*"))

    second = start_server(tmp_path, text, name="second")
    client = ReplayClient(second.address)
    saved = client.insert("replay", rows(100))
    assert not set(saved.tolist()) & set(crashed.tolist())
    assert client.update_priorities("replay", crashed, torch.ones(10)) == 0  # stale
    client.checkpoint()
    lost = client.insert("replay", rows(100, start=100))  # acknowledged, then lost in the crash
    assert second.stop(signal.SIGKILL) == -signal.SIGKILL

    third = start_server(tmp_path, text, name="third")
    try:
        client = ReplayClient(third.address)
        # A learner's late update for a lost id, right after the restart: stale, not an error.
        assert client.update_priorities("replay", lost[50:51], torch.tensor([9.0])) == 0
        new = client.insert("replay", rows(100, start=200))
        issued_before = set(crashed.tolist()) | set(saved.tolist()) | set(lost.tolist())
        assert not set(new.tolist()) & issued_before
        # Late updates for every lost id touch none of the new rows, and are counted.
        before = stale_updates(client)
        assert client.update_priorities("replay", lost, torch.full((100,), 1e6)) == 0
        assert stale_updates(client) - before == 100
        batch = client.sample("replay", 4000)
        new_drawn = torch.isin(batch.ids, new)
        assert 0.2 < new_drawn.float().mean() < 0.8  # no new row took a lost id's 1e6 priority
        assert torch.equal(batch.data["tag"][new_drawn] - 200, batch.ids[new_drawn] - new[0])
        # Rows restored from the checkpoint keep their ids; every id carries shard 3.
        assert client.update_priorities("replay", saved, torch.ones(100)) == 100
        everything = (*crashed.tolist(), *saved.tolist(), *lost.tolist(), *new.tolist())
        assert {i >> 56 for i in everything} == {3}
        info = client.server_info()
        assert info.shard == 3 and info.incarnation == (int(new[0]) >> 40) & 0xFFFF
        counter = tmp_path / "ckpt" / "INCARNATION"
        assert int(counter.read_text()) == info.incarnation
        assert counter.stat().st_mode & 0o077 == 0
    finally:
        third.stop()
