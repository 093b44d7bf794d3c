"""What RemoteReplayBuffer stores: extend past capacity, data that is not a TensorDict, rows read
and written by storage position, and checkpoints of a buffer (state_dict, dumps/loads)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, tensorclass

from replay_client import RemoteReplayBuffer, errors
from tests.client.remote_buffer.data import rows


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def test_extend_past_capacity_keeps_the_newest_rows(client, fresh) -> None:
    """6e15745 refused an extend larger than the table; TorchRL's ring keeps the newest rows."""
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4)  # capacity 10
    ids = rb.extend(rows(25))
    assert ids.shape == (25,) and len(rb) == 10
    assert rb[:]["x"].tolist() == [20, 21, 22, 23, 24, 15, 16, 17, 18, 19]  # as TorchRL's slots
    assert set(rb.sample(50)["x"].tolist()) <= set(range(15, 25))


def test_tensors_tensorclasses_and_tuples_come_back_as_they_went_in(client, fresh) -> None:
    plain = RemoteReplayBuffer(client, fresh("rows"), batch_size=4, include_info=False)
    plain.extend(torch.arange(12.0).reshape(6, 2))
    batch = plain.sample()
    assert isinstance(batch, torch.Tensor) and batch.shape == (4, 2)
    assert ((batch[:, 1] - batch[:, 0]) == 1).all()
    with pytest.raises(errors.InvalidArgumentError, match="holds tensor data"):
        plain.extend(TensorDict({"x": torch.zeros(2)}, [2]))

    classes = RemoteReplayBuffer(client, fresh("rows"), batch_size=3)
    classes.extend(Transition(obs=torch.randn(5, 3), reward=torch.ones(5), batch_size=[5]))
    assert isinstance(classes.sample(), Transition)

    pairs = RemoteReplayBuffer(client, fresh("rows"), batch_size=3)
    pairs.extend((torch.arange(5), {"a": torch.arange(5) * 2}))
    first, second = pairs.sample()
    assert torch.equal(second["a"], first * 2)
    assert pairs.add((torch.tensor(7), {"a": torch.tensor(14)})) > 0
    with pytest.raises(errors.InvalidArgumentError, match="stores tensors"):
        RemoteReplayBuffer(client, fresh("rows")).extend("text")


def test_rows_by_storage_position_and_by_id(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=4)
    data = rows(6)
    assert rb.extend(data).tolist() == list(range(6))  # storage positions, as TorchRL's
    ids = data["replay_id"]
    assert rb[2]["x"].item() == 2 and rb[-1]["x"].item() == 5
    assert rb[:3]["x"].tolist() == [0, 1, 2]
    assert rb[torch.tensor([4, 0])]["x"].tolist() == [4, 0]
    assert rb[ids[[5, 1]]]["x"].tolist() == [5, 1]
    assert len(rb.storage) == 6 and rb.storage.max_size == 100
    with pytest.raises(errors.InvalidArgumentError, match="holds no row"):
        rb[7]


def test_rows_written_by_position(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=4)
    rb.extend(rows(4))
    rb[0] = TensorDict({"x": torch.tensor(40), "obs": torch.full((2,), 40.0)}, [])
    rb[torch.tensor([1, 2])] = rows(2, start=41)
    assert rb[:]["x"].tolist() == [40, 41, 42, 3]
    rb.set_at_("x", torch.tensor([7]), torch.tensor([3]))
    assert rb[3]["x"].item() == 7
    rb.set_("obs", torch.zeros(4, 2))
    assert (rb[:]["obs"] == 0).all()
    rb.update_(TensorDict({"x": torch.arange(4) + 100}, [4]))
    assert rb[:]["x"].tolist() == [100, 101, 102, 103]


def test_state_dict_round_trip(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=4)
    rb.extend(rows(8))
    rb.update_priority(torch.arange(8), torch.arange(8) + 1.0)
    rb.sampler.beta = 0.9
    state = rb.state_dict()
    other = RemoteReplayBuffer(client, fresh("per"), batch_size=4)
    other.extend(rows(3, start=50))
    other.load_state_dict(state)
    assert other[:]["x"].tolist() == list(range(8))
    assert other.sampler.beta == pytest.approx(0.9)
    read = client.read(other.table, positions=range(8), priorities=True)
    assert read.priorities.tolist() == pytest.approx([float(i + 1) for i in range(8)], rel=1e-5)


def test_dumps_and_loads_stream_the_rows_through_files(client, fresh, tmp_path,
                                                       monkeypatch) -> None:
    from replay_client.torchrl import state

    monkeypatch.setattr(state, "CHUNK_ROWS", 3)  # several files, each a chunk of rows
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4)  # capacity 10
    rb.extend(rows(14))  # wrapped: positions 0..3 hold 10..13
    rb.dumps(tmp_path / "rb")
    assert len(list((tmp_path / "rb").glob("rows-*.pt"))) == 4
    other = RemoteReplayBuffer(client, fresh("rows"), batch_size=4)
    other.loads(tmp_path / "rb")
    assert other[:]["x"].tolist() == list(range(4, 14))  # oldest first from position 0
    other.extend(rows(1, start=99))
    assert 4 not in other[:]["x"].tolist()  # the oldest row is the next one overwritten


def test_rows_keep_their_own_batch_dims_as_in_torchrl_storages(client, fresh) -> None:
    """A [n, T] TensorDict is n rows of T steps (TorchRL's one-dimensional storages);
    6e15745 stored n * T rows of a row table."""
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=2)
    data = TensorDict({"x": torch.arange(12).reshape(4, 3)}, batch_size=[4, 3])
    rb.extend(data)
    assert len(rb) == 4 and data["index"].shape == (4, 3)
    batch = rb.sample()
    assert batch.batch_size == (2, 3) and batch["index"].shape == (2, 3)
    assert ((batch["x"][:, 1:] - batch["x"][:, :-1]) == 1).all()  # each row one trajectory
    assert rb["x"].shape == (4, 3)  # a column of every stored row


def test_empty_starts_over_schema_included(client, fresh) -> None:
    """6e15745's empty() kept the table's schema, so a buffer could not start over with other
    data; positions start at 0 again too."""
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=2)
    rb.extend(rows(7))
    rb.empty()
    assert len(rb) == 0
    rb.extend(TensorDict({"other": torch.arange(3.0)}, batch_size=[3]))
    assert rb[0]["other"].item() == 0.0 and set(rb.sample().keys()) == {"other", "index", "replay_id"}
