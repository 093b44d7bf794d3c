"""One TorchRL training loop's use of a replay buffer, recording what the loop sees.

Run against TorchRL's own buffers and against ``RemoteReplayBuffer`` by
``tests/client/test_torchrl_buffer.py``, which compares the two records. It
imports only torch, tensordict and (for TorchRL's side) torchrl, so it also
runs as a script in another virtualenv::

    python tests/client/torchrl_loop.py prioritized   # prints the record as JSON

The loop: extend with three collector batches (flattened to [N], as TorchRL
scripts do), sample, set ``td_error`` and ``update_tensordict_priority``,
then ``update_priority(index, priority)`` directly, and iterate. Rows are
marked ``hot`` (obs[0] < HOT) so priority effects can be measured.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch
from tensordict import TensorDict

BATCH = 32
ROWS_PER_EXTEND = 64
HOT = 16  # rows whose marker is below this get a high priority
DRAWS = 40


def collector_batch(start: int) -> TensorDict:
    """Like a TorchRL collector's output, flattened: obs[0] counts rows from 0."""
    n = ROWS_PER_EXTEND
    marker = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict({
        "observation": torch.stack([marker, torch.zeros(n), torch.ones(n), -marker], 1),
        "action": (torch.arange(n) % 2)[:, None],
        "next": {"observation": torch.zeros(n, 4), "reward": torch.ones(n, 1),
                 "done": torch.zeros(n, 1, dtype=torch.bool)},
    }, batch_size=[n])


def describe(td: TensorDict) -> dict[str, Any]:
    return {".".join(k) if isinstance(k, tuple) else k: [str(v.dtype), list(v.shape)]
            for k, v in sorted(td.items(include_nested=True, leaves_only=True),
                               key=lambda kv: str(kv[0]))}


def hot_share(rb: Any, draws: int = DRAWS) -> tuple[float, float | None, float | None]:
    """Share of sampled rows that are hot; mean weight of hot and cold rows (None: no weights)."""
    hot = total = 0
    hot_w: list[float] = []
    cold_w: list[float] = []
    for _ in range(draws):
        s = rb.sample()
        is_hot = s["observation"][:, 0] < HOT
        hot += int(is_hot.sum())
        total += is_hot.numel()
        if "priority_weight" in s.keys():
            hot_w += s["priority_weight"][is_hot].tolist()
            cold_w += s["priority_weight"][~is_hot].tolist()
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return hot / total, mean(hot_w), mean(cold_w)


def run_loop(rb: Any, prioritized: bool) -> dict[str, Any]:
    """The loop; returns what it saw (JSON-able)."""
    record: dict[str, Any] = {}
    extended = set()
    for i in range(3):
        data = collector_batch(i * ROWS_PER_EXTEND)
        index = rb.extend(data)
        extended.update(index.reshape(-1).tolist())
        if i == 0:
            record["extend_returns"] = [str(index.dtype), list(index.shape)]
            record["extend_sets_index"] = ("index" in data.keys()
                                           and torch.equal(data["index"], index))
    record["len"] = len(rb)
    one = collector_batch(10_000)[0]
    added = rb.add(one)
    record["add_returns_int"] = isinstance(added, int)
    record["len_after_add"] = len(rb)

    s = rb.sample()
    record["sample_keys"] = describe(s)
    record["sample_batch_size"] = list(s.batch_size)
    record["index_names_extended_rows"] = set(s["index"].tolist()) <= extended | {added}
    with warnings.catch_warnings():  # TorchRL warns that 8 differs from batch_size
        warnings.simplefilter("ignore")
        record["sample_of_8"] = list(rb.sample(8).batch_size)
    _, info = rb.sample(return_info=True)
    record["info_keys"] = sorted(info)
    if prioritized:
        weights = s["priority_weight"]
        record["weights"] = [str(weights.dtype), list(weights.shape)]
        record["weights_in_0_1"] = bool(((weights > 0) & (weights <= 1)).all())

    record["uniform_hot_share"] = hot_share(rb)[0]
    # A loss step: td_error from the batch, priorities updated through the TensorDict.
    with warnings.catch_warnings():  # a uniform buffer may warn: it has no priorities
        warnings.simplefilter("ignore")
        for _ in range(60):
            s = rb.sample()
            s["td_error"] = torch.where(s["observation"][:, 0] < HOT, 100.0, 0.01)
            rb.update_tensordict_priority(s)
    share, hot_w, cold_w = hot_share(rb)
    record["hot_share_after_td_updates"] = share
    if prioritized:
        record["hot_rows_weigh_less"] = hot_w is not None and cold_w is not None and hot_w < cold_w
    # Direct updates by index: every sampled row back to one priority (a uniform buffer warns).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(60):
            s = rb.sample()
            rb.update_priority(s["index"], torch.ones(s.batch_size))
    record["update_priority_warns"] = any("priorit" in str(w.message) for w in caught)
    record["hot_share_after_reset"] = hot_share(rb)[0]
    batch = next(iter(rb))
    record["iter_batch_size"] = list(batch.batch_size)
    return record


def torchrl_buffer(prioritized: bool) -> Any:
    from torchrl.data import (
        LazyTensorStorage,
        TensorDictPrioritizedReplayBuffer,
        TensorDictReplayBuffer,
    )

    storage = LazyTensorStorage(1000)
    if prioritized:
        return TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=storage,
                                                 batch_size=BATCH, priority_key="td_error")
    return TensorDictReplayBuffer(storage=storage, batch_size=BATCH)


def run_torchrl(kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    return run_loop(torchrl_buffer(kind == "prioritized"), kind == "prioritized")


if __name__ == "__main__":
    print(json.dumps(run_torchrl(sys.argv[1])))

