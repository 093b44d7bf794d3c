"""TorchRL's SliceSampler(strict_length=False), pad_output and span through a server: short
trajectories sampled, slices cut at a trajectory's end, TorchRL's markers at the last real
step, padding and ("collector", "mask"). Each refused before (UnsupportedComponentError)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedSliceSampler,
    SliceSampler,
    TensorDictReplayBuffer,
)

from replay_client import RemoteReplayBuffer, errors

MASK = ("collector", "mask")


def prioritized_slices(alpha: float = 0.6, beta: float = 0.4, **slices) -> PrioritizedSliceSampler:
    """TorchRL's PrioritizedSliceSampler; where its compiled sum trees do not load (torchrl
    0.13 on torch 2.13), the object without them: what the buffer reads of it is there."""
    try:
        return PrioritizedSliceSampler(max_capacity=1000, alpha=alpha, beta=beta, **slices)
    except RuntimeError:
        sampler = PrioritizedSliceSampler.__new__(PrioritizedSliceSampler)
        SliceSampler.__init__(sampler, **slices)
        sampler.__dict__.update(_max_capacity=1000, _alpha=alpha, _beta=beta, _eps=1e-8,
                                reduction="max")
        return sampler


def short_and_long(lengths=(2, 7, 3)) -> TensorDict:
    """Trajectories of ``lengths`` steps one after the other, with ``is_init`` at each first
    step and ``obs`` numbering the steps of each from 0."""
    parts = []
    for traj, length in enumerate(lengths):
        init = torch.zeros(length, 1, dtype=torch.bool)
        init[0] = True
        parts.append(TensorDict({"traj": torch.full((length,), traj), "is_init": init,
                                 "obs": torch.arange(length).float()}, [length]))
    return torch.cat(parts)


def _slices(batch: TensorDict) -> list[tuple[int, list[int]]]:
    """(traj, obs steps) of each slice, split at the truncated marks."""
    ends = batch["next", "truncated"].reshape(-1).nonzero().squeeze(-1).tolist()
    out, start = [], 0
    for end in ends:
        traj = batch["traj"][start:end + 1]
        assert (traj == traj[0]).all(), "a slice spans two trajectories"
        out.append((int(traj[0]), batch["obs"][start:end + 1].long().tolist()))
        start = end + 1
    assert start == batch.batch_size[0]
    return out


def test_short_trajectories_are_sampled_whole_and_slices_cut_at_their_end(client, fresh):
    rb = RemoteReplayBuffer(client, fresh("short"), batch_size=40, sampler=SliceSampler(
        slice_len=4, traj_key="traj", strict_length=False))
    rb.extend(short_and_long())
    seen = set()
    for _ in range(5):
        batch = rb.sample()
        assert batch.batch_size[0] <= 40
        assert MASK not in batch.keys(include_nested=True)
        starts = batch["is_init"].reshape(-1).nonzero().squeeze(-1).tolist()
        slices = _slices(batch)
        assert len(slices) == 10
        offset = 0
        for traj, steps in slices:
            assert offset in starts  # every slice starts with is_init
            offset += len(steps)
            assert steps == list(range(steps[0], steps[0] + len(steps)))
            assert len(steps) == min(4, {0: 2, 1: 7, 2: 3}[traj])
            seen.add(traj)
        assert torch.equal(batch["next", "done"], batch["next", "truncated"])
    assert seen == {0, 1, 2}


def test_pad_output_keeps_slice_len_steps_repeats_the_last_one_and_masks(client, fresh):
    rb = RemoteReplayBuffer(client, fresh("short"), batch_size=40, sampler=SliceSampler(
        slice_len=4, traj_key="traj", strict_length=False, pad_output=True))
    rb.extend(short_and_long())
    for _ in range(50):  # a batch with a short slice (each batch has one with p > 0.98)
        batch = rb.sample()
        if MASK in batch.keys(include_nested=True):
            break
    assert batch.batch_size == (40,)
    mask = batch[MASK].reshape(10, 4)
    assert not mask.all()
    assert batch[MASK].dtype == torch.bool and batch[MASK].shape == (40,)
    obs, traj = batch["obs"].reshape(10, 4), batch["traj"].reshape(10, 4)
    truncated = batch["next", "truncated"].reshape(10, 4)
    assert batch["is_init"].reshape(10, 4)[:, 0].all()
    for row in range(10):
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert n == min(4, {0: 2, 1: 7, 2: 3}[int(traj[row, 0])])
        assert (obs[row, n:] == obs[row, n - 1]).all()  # padded with the last real step
        assert truncated[row, n - 1] and truncated[row].sum() == 1


def test_pad_output_leaves_the_mask_out_when_no_slice_is_short(client, fresh):
    """TorchRL's test_slice_sampler_mask_all_long_trajs_no_mask: with every trajectory long
    enough TorchRL's padded batches have no mask; ours had one (all True) in every batch."""
    data = short_and_long((6, 9, 5))
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=40,
                                    sampler=SliceSampler(slice_len=4, traj_key="traj",
                                                         strict_length=False, pad_output=True))
    theirs.extend(data.clone())
    ours = RemoteReplayBuffer(client, fresh("short"), batch_size=40, sampler=SliceSampler(
        slice_len=4, traj_key="traj", strict_length=False, pad_output=True))
    ours.extend(data.clone())
    for rb in (theirs, ours):
        for _ in range(5):
            batch = rb.sample()
            assert batch.batch_size == (40,)
            assert MASK not in batch.keys(include_nested=True)


def test_strict_samplers_on_a_partial_table_and_the_reverse_are_refused(client, fresh):
    with pytest.raises(errors.TableMismatchError, match="set strict_length = false"):
        RemoteReplayBuffer(client, fresh("seq"),
                           sampler=SliceSampler(slice_len=4, strict_length=False))
    with pytest.raises(errors.TableMismatchError, match="set strict_length = true"):
        RemoteReplayBuffer(client, fresh("short"), sampler=SliceSampler(slice_len=4))
    with pytest.raises(errors.TableMismatchError, match="set span_right = 3"):
        RemoteReplayBuffer(client, fresh("span"), sampler=prioritized_slices(
            slice_len=4, span=(False, True)))


def test_prioritized_partial_slices_update_by_the_index_returned(client, fresh):
    sampler = prioritized_slices(1.0, 1.0, slice_len=4, traj_key="traj", strict_length=False)
    rb = RemoteReplayBuffer(client, fresh("pshort"), batch_size=40, sampler=sampler)
    rb.extend(short_and_long())
    batch = rb.sample()
    assert "priority_weight" in batch.keys()
    short = batch["traj"] == 0
    assert short.any()
    # Every row but the short trajectory's loses its mass (by storage position, and by the
    # index a sample returned): only that one is drawn.
    rb.update_priority(torch.arange(12), (torch.arange(12) < 2).double())
    rb.update_priority(batch["index"], (batch["traj"] == 0).double())
    for _ in range(3):
        again = rb.sample()
        assert (again["traj"] == 0).all() and again.batch_size == (20,)


def test_a_right_span_cuts_slices_at_the_end_of_a_trajectory(client, fresh):
    rb = RemoteReplayBuffer(client, fresh("span"), batch_size=400, sampler=prioritized_slices(
        slice_len=4, traj_key="traj", span=(False, 2)))
    rb.extend(short_and_long((1, 6)))
    lengths = {}
    for traj, steps in _slices(rb.sample()):
        lengths.setdefault(steps[0], set()).add(len(steps))
        assert traj == 1  # the 1-step trajectory is shorter than slice_len - span_right
    assert lengths == {0: {4}, 1: {4}, 2: {4}, 3: {3}, 4: {2}}


def test_spans_on_both_sides_cut_slices_at_either_end(client, fresh):
    rb = RemoteReplayBuffer(client, fresh("spans"), batch_size=400, sampler=SliceSampler(
        num_slices=100, traj_key="traj", span=(2, 2)))
    rb.extend(short_and_long((6, 6)))
    found = set()
    for _, steps in _slices(rb.sample()):
        found.add((steps[0], len(steps)))
    # Left windows keep 2 or 3 steps from step 0; right ones end at step 5 with 2 or 3.
    assert found == {(0, 2), (0, 3), (0, 4), (1, 4), (2, 4), (3, 3), (4, 2)}


def test_init_key_none_leaves_the_stored_flags_as_stored(client, fresh):
    """The sampler's init_key was not read: is_init was OR-ed with slice starts even where
    TorchRL's SliceSampler(init_key=None) leaves the stored flags alone (DreamerV3's RSSM)."""
    sampler = SliceSampler(slice_len=4, traj_key="traj", strict_length=False)
    sampler.init_key = None  # (a constructor argument from torchrl 0.14 on)
    rb = RemoteReplayBuffer(client, fresh("short"), batch_size=40, sampler=sampler)
    rb.extend(short_and_long())
    batch = rb.sample()
    assert torch.equal(batch["is_init"].reshape(-1), batch["obs"] == 0)  # stored: first steps
