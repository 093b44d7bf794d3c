"""RemoteReplayBuffer.sample as TorchRL's: batch sizes in steps (slices too), trajectory
markers, trajectories found in 1-D data, and an empty buffer that raises at once."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SliceSampler

from replay_client import RemoteReplayBuffer, errors
from tests.client.remote_buffer.data import rows, trajectories


def test_slice_batch_size_counts_steps_and_marks_slice_ends(client, fresh) -> None:
    """6e15745 returned [8, 4] for batch_size=8 on a 4-step slice table: 4x the data TorchRL
    returns, silently."""
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=8)
    rb.extend(trajectories(3, 10))  # 1-D, no episode column: split by ("next", "done")
    batch = rb.sample()
    assert batch.batch_size == (8,)
    steps, traj = batch["step"].reshape(2, 4), batch["traj"].reshape(2, 4)
    assert (steps[:, 1:] - steps[:, :-1] == 1).all()
    assert (traj == traj[:, :1]).all(), "a slice spans two trajectories"
    truncated = batch["next", "truncated"].reshape(2, 4)
    assert truncated[:, -1].all() and not truncated[:, :-1].any()
    done = batch["next", "done"].reshape(2, 4)
    assert done[:, -1].all()  # the stored flag OR the slice end, as TorchRL's markers
    assert "episode" not in batch.keys()  # the buffer's own column stays out of samples
    assert batch["index"].shape == (8,)
    with pytest.raises(errors.InvalidArgumentError, match="multiple of 4"):
        rb.sample(6)


def test_slice_sampler_objects_are_checked_against_the_table(client, fresh) -> None:
    table = fresh("seq")
    rb = RemoteReplayBuffer(client, table, sampler=SliceSampler(num_slices=3), batch_size=12)
    rb.extend(trajectories(2, 8))
    assert rb.sample().batch_size == (12,)
    with pytest.raises(errors.TableMismatchError, match="slice_len = 5"):
        RemoteReplayBuffer(client, table, sampler=SliceSampler(slice_len=5))
    with pytest.raises(errors.TableMismatchError, match="capacity = 64"):
        RemoteReplayBuffer(client, table, storage=LazyTensorStorage(64),
                           sampler=SliceSampler(slice_len=4))
    with pytest.raises(errors.TableMismatchError, match="samples slices"):
        RemoteReplayBuffer(client, table, storage=LazyTensorStorage(1000))


def test_trajectories_are_found_by_traj_key(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=40,
                            sampler=SliceSampler(slice_len=4, traj_key="traj"))
    rb.extend(trajectories(5, 6, done=False))  # no end flags: the traj ids alone split them
    traj = rb.sample()["traj"].reshape(10, 4)
    assert (traj == traj[:, :1]).all()


@pytest.mark.parametrize("sampler", [None, SliceSampler(slice_len=4)])
def test_collector_traj_ids_split_trajectories_when_no_key_is_named(client, fresh,
                                                                     sampler) -> None:
    """53d2f84 ignored ("collector", "traj_ids") unless named: without end flags, slices ran
    across trajectories, silently (TorchRL's SliceSampler given no key finds that one)."""
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=400, sampler=sampler)
    data = trajectories(5, 6, done=False)
    data["collector", "traj_ids"] = data["traj"]
    rb.extend(data)
    traj = rb.sample()["traj"].reshape(100, 4)
    assert (traj == traj[:, :1]).all()
    assert rb.sampler.traj_key == ("collector", "traj_ids")


def test_a_trajectory_left_open_goes_on_in_the_next_extend(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=400)
    rb.extend(trajectories(1, 6, done=False))
    rb.extend(trajectories(1, 6, start=6))  # steps 6..11 end at 11: one trajectory of 12
    steps = rb.sample()["step"].reshape(100, 4)
    assert (steps[:, 1:] - steps[:, :-1] == 1).all()
    assert ((steps[:, 0] == 4) | (steps[:, 0] == 5)).any()  # slices across the two extends


def test_an_empty_buffer_raises_a_runtime_error_at_once(client, fresh) -> None:
    """6e15745 waited for the client's timeout, then raised DeadlineExceededError; TorchRL code
    catches RuntimeError."""
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4)
    with pytest.raises(RuntimeError) as caught:
        rb.sample()
    assert isinstance(caught.value, errors.EmptyTableError)
    assert "wait=True" in str(caught.value)


def test_a_buffer_asked_to_wait_waits_for_rows(client, fresh) -> None:
    table = fresh("rows")
    rb = RemoteReplayBuffer(client, table, batch_size=4, wait=True, timeout=60)
    got: list = []
    sampler = threading.Thread(target=lambda: got.append(rb.sample()))
    sampler.start()
    RemoteReplayBuffer(client, table).extend(rows(5))
    sampler.join(timeout=60)
    assert got and got[0].batch_size == (4,)


def test_plain_buffers_return_the_data_alone_and_info_apart(client, fresh) -> None:
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=4, include_info=False)
    data = rows(5)
    rb.extend(data)
    assert "index" not in data.keys()  # TorchRL's ReplayBuffer leaves the data alone
    batch, info = rb.sample(return_info=True)
    assert set(batch.keys()) == {"x", "obs"}
    assert set(info) == {"index", "replay_id", "priority_weight"} and info["index"].shape == (4,)


def test_plain_slice_buffers_keep_the_stored_flags_and_mark_slices_in_info(client, fresh) -> None:
    """de75cc4 dropped the stored ("next", "done") from a plain buffer's slice samples (its
    markers went to info only): TorchRL's ReplayBuffer returns the flags as stored, so its
    transforms (NextStateReconstructor) read them."""
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=8, include_info=False)
    rb.extend(trajectories(2, 8))
    batch, info = rb.sample(return_info=True)
    stored = batch["next", "done"].reshape(2, 4)
    steps = batch["step"].reshape(2, 4)
    assert torch.equal(stored, steps % 8 == 7)  # True at episode ends only, as stored
    assert info["next", "done"].reshape(2, 4)[:, -1].all()  # the markers, apart
    assert ("next", "truncated") not in batch.keys(include_nested=True)


def test_transform_applies_to_samples_and_its_inverse_to_writes(client, fresh) -> None:
    class Double:
        def __call__(self, td: TensorDict) -> TensorDict:
            return td.set("obs", td["obs"] * 2)

        def inv(self, td: TensorDict) -> TensorDict:
            return td.set("obs", td["obs"] + 100)

    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4, transform=Double())
    rb.extend(rows(5))
    batch = rb.sample()
    assert torch.equal(batch["obs"], (batch["x"].float()[:, None] + 100).expand(4, 2) * 2)


def test_insert_transform_out_of_range_is_refused(client, fresh) -> None:
    """Inserted anywhere before (list.insert): TorchRL's Compose refuses an index past its end."""
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4)
    rb.insert_transform(0, lambda td: td)
    with pytest.raises(ValueError, match="index 10 is out of range"):
        rb.insert_transform(10, lambda td: td)


def test_add_of_a_batched_tensordict_warns_as_torchrl(client, fresh, monkeypatch) -> None:
    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=4)
    with pytest.warns(UserWarning, match=r"Using `add\(\)` with a TensorDict that has batch_size"):
        rb.add(rows(1))
    monkeypatch.setenv("RL_WARNINGS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rb.add(rows(1))
    assert len(rb) == 2


def test_collate_and_inverted_transforms_and_schedulers_on_the_buffer(client, fresh) -> None:
    from torchrl.data.replay_buffers.scheduler import LinearScheduler

    class Shift:
        def __call__(self, td: TensorDict) -> TensorDict:
            return td.set("obs", td["obs"] + 1)

        def inv(self, td: TensorDict) -> TensorDict:
            return td.set("obs", td["obs"] - 1)

    seen = []
    rb = RemoteReplayBuffer(client, fresh("per"), batch_size=4,
                            collate_fn=lambda td: seen.append(td.batch_size) or td)
    rb.append_transform(Shift(), invert=True)  # writes get obs + 1, samples obs - 1
    rb.extend(rows(5))
    assert torch.equal(client.read(rb.table, positions=[2]).columns["obs"], torch.full((1, 2), 3.0))
    batch = rb.sample()
    assert seen == [torch.Size([4])]
    assert torch.equal(batch["obs"], batch["x"].float()[:, None].expand(4, 2))
    assert rb.share() is rb
    scheduler = LinearScheduler(rb, param_name="beta", final_value=1.0, num_steps=2)
    scheduler.step()
    scheduler.step()
    assert rb.sampler.beta == pytest.approx(1.0)


def test_slice_options_without_a_server_counterpart_are_refused(client, fresh) -> None:
    """Static trajectories were ignored before, silently: TorchRL keeps them in a cache, not
    in the attribute the buffer read."""
    with pytest.raises(errors.UnsupportedComponentError, match="trajectories=... or ends="):
        RemoteReplayBuffer(client, fresh("seq"), sampler=SliceSampler(
            slice_len=4, trajectories=torch.zeros(8, dtype=torch.int64), cache_values=True))


def test_torchrl_service_calls_and_shared_transforms(client, fresh) -> None:
    class Counting:
        is_shared = False

        def __call__(self, td: TensorDict) -> TensorDict:
            return td

        def share_memory_(self) -> None:
            self.is_shared = True

    class KeepsWriteState(Counting):
        share_memory_ = None
        requires_shared_write_state = True

    rb = RemoteReplayBuffer(client, fresh("rows"), batch_size=2, shared=True)
    transform = Counting()
    rb.append_transform(transform)
    assert transform.is_shared
    with pytest.raises(RuntimeError, match="write state"):
        rb.append_transform(KeepsWriteState())
    assert rb.client() is rb and rb.start() is rb and rb.is_alive
    rb.extend(rows(3))
    rb.shutdown()
    assert not rb.is_alive
    with pytest.raises(RuntimeError, match="shut down"):
        rb.sample()


def test_a_sample_s_markers_are_its_own_when_written_in_place(client, fresh) -> None:
    """A batch of full slices takes its markers from masks made once per batch shape: a
    learner that writes into a sample's markers (or its info's) in place must leave the
    next sample's markers as TorchRL's."""
    rb = RemoteReplayBuffer(client, fresh("seq"), batch_size=8)
    data = trajectories(3, 10)
    data["is_init"] = (data["step"] % 10 == 0)[:, None]
    rb.extend(data)
    keys = [("next", "truncated"), ("next", "done"), ("next", "terminated"), "is_init"]
    for _ in range(3):
        batch, info = rb.sample(return_info=True)
        ends = torch.tensor([False, False, False, True] * 2)[:, None]
        for key in keys[:2]:
            assert torch.equal(batch[key], ends), key
        assert not batch["next", "terminated"].any()
        assert torch.equal(batch["is_init"], torch.tensor([True, False, False, False] * 2)[:, None])
        for key in keys:
            batch[key].fill_(True)
            info[key].logical_not_()
