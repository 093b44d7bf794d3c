"""A sample's ``"index"`` is TorchRL's: storage positions; the ids ride under ``"replay_id"``.

Issue 32: ``index`` held 62-bit ids, so TorchRL's rb tutorial
(``sample["td_error"] = N - sample["index"]``, ``plt.hist(sample["index"])``)
gave wrong priorities with no error and a histogram that failed.
"""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from replay_client import RemoteReplayBuffer, ReplayClient, errors
from tests.client.remote_buffer.data import rows
from tests.conftest import start_server

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

N = 100  # the "per" tables' capacity


def _mean_index(rb: RemoteReplayBuffer, draws: int = 10) -> float:
    return float(torch.cat([rb.sample(64)["index"] for _ in range(draws)]).float().mean())


def test_the_tutorials_arithmetic_on_index_moves_the_draws(client, fresh) -> None:
    """TorchRL's rb tutorial: priorities N - index make low positions likelier. With ids
    under "index" every priority was about the same huge number and nothing moved."""
    rb = RemoteReplayBuffer(client, fresh("per"), alpha=1.0, beta=0.4, batch_size=64)
    rb.extend(rows(N))
    before = _mean_index(rb)
    assert 40 < before < 60  # uniform over 0..99
    for _ in range(30):
        sample = rb.sample()
        sample["td_error"] = N - sample["index"]
        rb.update_tensordict_priority(sample)
    after = _mean_index(rb)
    assert after < 42, (before, after)  # p ~ N - i: a mean near N / 3


def test_index_reads_back_the_sampled_rows_as_torchrls_does(client, fresh) -> None:
    """The same rows, extended past capacity into ours and TorchRL's buffer (capacity 10):
    extend returns the same positions, and rb[sample["index"]] is the sample's rows in both."""
    ours = RemoteReplayBuffer(client, fresh("rows"), batch_size=32)
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=32)
    for start, count in ((0, 7), (7, 8), (15, 3)):
        data = rows(count, start)
        assert ours.extend(data.clone()).tolist() == theirs.extend(data.clone()).tolist()
    for rb in (ours, theirs):
        sample = rb.sample()
        assert sample["index"].dtype == torch.int64
        assert ((sample["index"] >= 0) & (sample["index"] < 10)).all()
        assert torch.equal(rb[sample["index"]]["x"], sample["x"])
        assert torch.equal(sample["x"] % 10, sample["index"])  # row x sits at x % 10
    assert (N - ours.sample()["index"]).min() > N - 10


def test_index_histograms_as_positions(client, fresh) -> None:
    """plt.hist(sample["index"]) failed ("Too many bins") on 62-bit ids."""
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=256)
    rb.extend(rows(N))
    index = rb.sample()["index"]
    counts, edges = np.histogram(index.numpy(), bins=10, range=(0, N))
    assert counts.sum() == 256 and (counts > 0).all()
    counts, _, _ = plt.hist(index, bins=10)
    assert counts.sum() == 256
    plt.close("all")


def test_updates_through_the_ids_leave_overwritten_rows_alone(client, fresh) -> None:
    """update_tensordict_priority takes "replay_id": a sample's rows overwritten since are
    ignored and counted, never given to the newer rows at the same positions."""
    table = fresh("per")
    rb = RemoteReplayBuffer(client, table, alpha=1.0, batch_size=16)
    rb.extend(rows(N))
    sample = rb.sample()
    assert set(sample.keys()) >= {"index", "replay_id"}
    assert not torch.equal(sample["index"], sample["replay_id"])
    rb.extend(rows(N, start=N))  # every row overwritten, same positions
    stale = client.info()[table].counters["stale_priority_updates"]
    sample["td_error"] = torch.full((16,), 1000.0)
    rb.update_tensordict_priority(sample)
    assert client.info()[table].counters["stale_priority_updates"] - stale == 16  # each id sent
    read = client.read(table, positions=sample["index"].numpy(), columns=False, priorities=True)
    assert (read.priorities < 1000).all()  # the newer rows kept theirs


def test_positions_hold_across_a_server_restart(tmp_path) -> None:
    """After a restart the server issues ids of a new incarnation (id segment) from the
    position its checkpoint reached: positions of old and new rows are both right."""
    config = (f'[server]\ncheckpoint_dir = "{tmp_path / "ckpt"}"\n\n'
              f'[[tables]]\nname = "t"\ncapacity = 16\nsampler = "uniform"\n')
    server = start_server(tmp_path, config)
    try:
        first = RemoteReplayBuffer(server.address, "t")
        first.extend(rows(11))
        first.shutdown()
    finally:
        server.stop()
    server = start_server(tmp_path, config)
    try:
        client = ReplayClient(server.address)
        rb = RemoteReplayBuffer(client, "t", batch_size=64)
        data = rows(9, start=11)  # positions 11..15, then 0..3 (rows 0..3 overwritten)
        assert rb.extend(data).tolist() == [11, 12, 13, 14, 15, 0, 1, 2, 3]
        segments = client.info()["t"].id_segments
        assert len(segments) == 2  # the first run's rows 4..10 and this run's
        sample = rb.sample()
        assert set(sample["x"].tolist()) <= set(range(4, 20))
        assert sorted(rb[:]["x"].tolist()) == list(range(4, 20))
        assert torch.equal(sample["index"], sample["x"] % 16)
        assert torch.equal(rb[sample["index"]]["x"], sample["x"])
        got = client.read("t", positions=sample["index"].numpy(), columns=False)
        assert torch.equal(torch.as_tensor(got.ids), sample["replay_id"])
        client.close()
    finally:
        server.stop()


def test_index_over_shards_lays_the_shards_rings_end_to_end(tmp_path) -> None:
    """A sharded client's positions: shard k's ring after the shards before it, so
    positions run over 0..summed capacity - 1 and name one row each."""
    config = '[[tables]]\nname = "t"\ncapacity = 8\nsampler = "uniform"\n'
    servers = [start_server(tmp_path, f'[server]\nshard = {k}\n\n{config}', name=f"s{k}")
               for k in range(2)]
    try:
        client = ReplayClient([s.address for s in servers])
        rb = RemoteReplayBuffer(client, "t", batch_size=256)
        parts = [TensorDict({"x": torch.arange(k, k + 6)}, [6]) for k in (0, 6)]
        for part in parts:  # round-robin: one insert to each shard
            rb.extend(part)
        data = torch.cat(parts)
        assert client.info()["t"].capacity == 16
        index = data["index"]
        assert ((index >= 0) & (index < 16)).all() and len(set(index.tolist())) == 12
        shard = torch.as_tensor(data["replay_id"].numpy() >> 56)
        assert set(shard.tolist()) == {0, 1}
        assert torch.equal(index >= 8, shard == 1)
        sample = rb.sample()
        by_x = dict(zip(data["x"].tolist(), index.tolist()))
        assert [by_x[x] for x in sample["x"].tolist()] == sample["index"].tolist()
        assert torch.equal(rb[sample["index"]]["x"], sample["x"])  # read from each shard
        assert torch.equal(rb[sample["replay_id"]]["x"], sample["x"])
        with pytest.raises(errors.InvalidArgumentError, match="outside 0..15"):
            rb[torch.tensor([16])]
        client.close()
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize("capacity", [10, 7])
def test_position_arithmetic_matches_the_servers_reads(client, fresh, capacity) -> None:
    """Every stored row's computed position is where the server reads it (wrapped too)."""
    table = fresh("rows")  # capacity 10
    rb = RemoteReplayBuffer(client, table)
    rb.extend(rows(23))
    rb.extend(rows(capacity, start=23))
    positions = np.arange(10)
    ids = torch.as_tensor(client.read(table, positions=positions, columns=False).ids)
    assert rb.positions(ids).tolist() == positions.tolist()
