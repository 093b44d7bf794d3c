"""RemoteReplayBuffer against TorchRL's own buffers: one TorchRL loop runs against both and
what it sees (keys, shapes, dtypes, index/priority_weight, priority updates taking effect) is
compared.

TorchRL's uniform buffer runs here (torchrl in the test extra; its pure-Python parts work with
this torch). Its prioritized buffer needs TorchRL's compiled extension, which loads only with
the torch it was built for: that side runs in the TorchRL virtualenv (``TORCHRL_PYTHON``, or
``.venv-torchrl`` at the repository root, made by ``make bench-engine``) and the test is skipped,
saying so, when there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from replay_client import RemoteReplayBuffer, ReplayClient, errors
from tests.client import torchrl_loop
from tests.conftest import module_server

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
[[tables]]
name = "uniform_a"
capacity = 1000

[[tables]]
name = "per_a"
capacity = 1000
sampler = "prioritized"
alpha = 0.6
beta = 0.4

[[tables]]
name = "misc"
capacity = 1000
sampler = "prioritized"

[[tables]]
name = "seq"
capacity = 1000
sampler = "slice"
slice_len = 4
done_key = "next.done"
"""

served = module_server(CONFIG)


def torchrl_python() -> str | None:
    candidate = os.environ.get("TORCHRL_PYTHON") or str(ROOT / ".venv-torchrl" / "bin" / "python")
    return candidate if Path(candidate).exists() else None


def ours(served, table: str) -> dict:
    torch.manual_seed(0)
    rb = RemoteReplayBuffer(served.address, table, batch_size=torchrl_loop.BATCH)
    return torchrl_loop.run_loop(rb, "per" in table)


def compare(theirs: dict, mine: dict, prioritized: bool) -> None:
    # extend_sets_index differs between TorchRL releases (0.13 leaves the caller's TensorDict
    # alone); ours always sets it, which update_tensordict_priority after extend relies on.
    assert mine["extend_sets_index"]
    # Our id key rides beside TorchRL's keys (docs/torchrl.md, "Key names"); the rest match.
    assert "replay_id" in mine["sample_keys"] and "replay_id" in mine["info_keys"]
    mine = {**mine, "info_keys": [k for k in mine["info_keys"] if k != "replay_id"],
            "sample_keys": {k: v for k, v in mine["sample_keys"].items() if k != "replay_id"}}
    structural = ["extend_returns", "len", "add_returns_int",
                  "len_after_add", "sample_keys", "sample_batch_size", "index_names_extended_rows",
                  "sample_of_8", "info_keys", "iter_batch_size", "update_priority_warns"]
    if prioritized:
        structural += ["weights", "weights_in_0_1", "hot_rows_weigh_less"]
    for key in structural:
        assert mine[key] == theirs[key], f"{key}: ours {mine[key]!r}, TorchRL's {theirs[key]!r}"
    base = torchrl_loop.HOT / (3 * torchrl_loop.ROWS_PER_EXTEND + 1)
    for record in (theirs, mine):
        assert record["uniform_hot_share"] < 2 * base + 0.1
        assert record["hot_share_after_reset"] < 2 * base + 0.1
        if prioritized:  # 100 vs 0.01 priorities: nearly every draw is hot
            assert record["hot_share_after_td_updates"] > 0.8, record
        else:  # update_tensordict_priority is a no-op without priorities
            assert record["hot_share_after_td_updates"] < 2 * base + 0.1


def test_uniform_loop_sees_what_it_sees_with_torchrl(served) -> None:
    theirs = torchrl_loop.run_torchrl("uniform")
    compare(theirs, ours(served, "uniform_a"), prioritized=False)


def test_prioritized_loop_sees_what_it_sees_with_torchrl(served) -> None:
    python = torchrl_python()
    if python is None:
        pytest.skip("TorchRL's prioritized buffer needs its compiled extension, which does not "
                    "load with torch 2.13: set TORCHRL_PYTHON to a TorchRL virtualenv's python "
                    "(make bench-engine creates .venv-torchrl)")
    result = subprocess.run(
        [python, str(ROOT / "tests" / "client" / "torchrl_loop.py"), "prioritized"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    compare(theirs, ours(served, "per_a"), prioritized=True)


def test_extend_of_envs_by_time_sets_index_shaped_like_the_batch(served) -> None:
    rb = RemoteReplayBuffer(ReplayClient(served.address), "seq", batch_size=8)
    td = TensorDict({"obs": torch.arange(12.0).reshape(3, 4, 1),
                     "next": {"done": torch.zeros(3, 4, 1, dtype=torch.bool)}}, [3, 4])
    ids = rb.extend(td)
    assert ids.shape == (12,) and td["index"].shape == (3, 4)
    assert torch.equal(td["index"].reshape(-1), ids)
    batch = rb.sample()  # 8 steps: two slices of 4, flat, as TorchRL's SliceSampler
    assert batch.batch_size == (8,) and "priority_weight" not in batch.keys()
    obs = batch["obs"].reshape(2, 4)
    assert (obs[:, 1:] - obs[:, :-1] == 1).all()  # one env's steps in order


def test_extend_keeps_episodes_whole_across_collector_batches(served) -> None:
    rb = RemoteReplayBuffer(served.address, "seq", batch_size=4)
    rb.empty()
    for round_ in range(2):  # one episode per env, spanning both batches
        steps = torch.arange(3)[:, None] * 100 + round_ * 2 + torch.arange(2)[None, :]
        rb.extend(TensorDict({"obs": steps[..., None].float(),
                              "next": {"done": torch.zeros(3, 2, 1, dtype=torch.bool)}}, [3, 2]))
    batch = rb.sample(64)  # 16 slices of 4 steps
    assert (batch["obs"].reshape(16, 4) % 100 == torch.arange(4)).all()  # slices span batches


def test_extend_with_priorities_and_reinserted_samples(served) -> None:
    rb = RemoteReplayBuffer(served.address, "misc", batch_size=16)
    td = TensorDict({"x": torch.arange(20.0), "td_error": torch.cat(
        [torch.full((2,), 1000.0), torch.full((18,), 0.001)])}, [20])
    rb.extend(td)
    s = rb.sample()
    assert (s["x"] < 2).float().mean() > 0.8  # extend's priorities were applied
    assert s["td_error"].shape == (16,)  # ... and kept as data, as TorchRL stores them
    before = len(rb)
    rb.extend(s)  # a sample's index and weights are not stored again as data
    assert len(rb) == before + 16
    assert "index" not in ReplayClient(served.address).info()["misc"].schema


def test_refused_input_names_the_problem(served) -> None:
    rb = RemoteReplayBuffer(served.address, "misc")
    with pytest.raises(errors.InvalidArgumentError, match="stores tensors"):
        rb.extend("not data")
    with pytest.raises(errors.InvalidArgumentError, match="batch_size"):
        rb.sample()
    with pytest.raises(errors.InvalidPriorityError, match="do not fit"):
        rb.update_priority(torch.zeros(3, dtype=torch.int64), torch.ones(2))


def test_the_loop_module_runs_as_a_script_without_our_packages() -> None:
    source = (ROOT / "tests" / "client" / "torchrl_loop.py").read_text()
    assert "replay_" not in source.split('"""', 2)[2]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
