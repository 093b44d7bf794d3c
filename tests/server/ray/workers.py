"""The writers and learners the Ray tests run beside a replay: Ray tasks and one actor.

``write`` and ``learn`` are tasks (one writer or learner each, placed by the caller's
``resources``); ``Worker`` is one actor that runs a writer and a learner at once, in
threads, until told to stop (bounded in count), for the tests that kill, lose or scale
a shard under them. Each takes a client as its argument (a sharded ``ReplayClient``
pickles as its settings: the task or actor connects by itself).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.server.ray.conftest import SKIP_REASON

ray = pytest.importorskip("ray", reason=SKIP_REASON, exc_type=ImportError)


@ray.remote(num_cpus=0.5)
def write(client, table: str, first: int, rows: int) -> list[int]:
    """Rows ``first .. first+rows-1`` (key, priority 1 + key % 7) in inserts of 16: their ids."""
    ids = []
    for start in range(first, first + rows, 16):
        keys = torch.arange(start, min(start + 16, first + rows), dtype=torch.int64)
        ids += client.insert(table, {"key": keys}, priorities=1.0 + (keys % 7).double()).tolist()
    return ids


@ray.remote(num_cpus=0.5)
def learn(client, table: str, batches: int) -> dict[int, float]:
    """A learner: streams ``batches`` batches, updating each row's priority to 0.5 + key % 5
    on the stream; the priorities it set, by id."""
    set_to = {}
    stream = client.stream(table, 32, num_batches=batches)
    for batch in stream:
        new = 0.5 + (batch.data["key"] % 5).double()
        stream.update_priorities(batch.ids, new)
        set_to.update(zip(batch.ids.tolist(), new.tolist()))
    stream.close()
    return set_to


@ray.remote(num_cpus=0.5)
class Worker:
    """A writer and a learner on the head node (each call its own client: Ray unpickles
    the argument per call; both run at once, in threads), until told to stop (bounded)."""

    def __init__(self) -> None:
        self.stopping = False
        self.seen: list[tuple[tuple[int, ...], list[int]]] = []

    def reset(self) -> None:
        """Ready for the next test: not stopping, no batches seen."""
        self.stopping = False
        self.seen = []

    def write(self, client, most: int = 3000) -> list[int]:
        ids: list[int] = []
        for k in range(most):
            if self.stopping:
                break
            ids += client.insert("u", {"key": torch.arange(8)}).tolist()
            time.sleep(0.01)
        client.close()
        return ids

    def learn(self, client, most: int = 20_000) -> list[tuple[tuple[int, ...], list[int]]]:
        """Each batch's missing shards and the shards its rows came from."""
        self.seen = []
        stream = client.stream("u", 16)
        for _, batch in zip(range(most), stream):
            self.seen.append((batch.missing_shards, sorted(set((batch.ids >> 56).tolist()))))
            if self.stopping:
                break
            time.sleep(0.005)
        stream.close()
        client.close()
        return self.seen

    def seen_now(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """The learner's batches so far (missing shards, shards drawn from)."""
        return list(getattr(self, "seen", []))

    def rejoined(self) -> bool:
        """Whether the learner had a batch without shard 1, then one with its rows again."""
        seen = list(getattr(self, "seen", []))
        missing = [i for i, (gone, _) in enumerate(seen) if gone == (1,)]
        return bool(missing) and any(1 in shards for _, shards in seen[missing[-1]:])

    def stop(self) -> None:
        self.stopping = True
