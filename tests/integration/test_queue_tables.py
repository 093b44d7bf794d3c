"""Queue and stack tables through a real server: consume-once under concurrent actors and
learners, in order; inserts that wait at max_size (and their deadlines); deletes; info,
metrics; checkpoints keep the queue order.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient, errors
from tests.conftest import module_server, wait_for

WAIT_LIMIT_S = 60

CONFIG = """
[server]
workers = 2

[[tables]]
name = "work"
capacity = 10000
sampler = "fifo"

[[tables]]
name = "bounded"
capacity = 100
sampler = "fifo"
max_size = 10

[[tables]]
name = "stack"
capacity = 100
sampler = "lifo"

[[tables]]
name = "ordered"
capacity = 1000
sampler = "fifo"

[[tables]]
name = "plain"
capacity = 100
"""

server = module_server(CONFIG)


def rows(values: list[int], actor: int = 0) -> dict[str, torch.Tensor]:
    return {"value": torch.tensor(values, dtype=torch.int64),
            "actor": torch.full((len(values),), actor, dtype=torch.int64)}


def test_every_row_is_taken_exactly_once_in_order_under_concurrent_actors_and_learners(
        server) -> None:
    actors, calls, per_call, batch = 3, 40, 5, 8
    total = actors * calls * per_call
    taken: list[list[int]] = []
    batches: list = []
    failures: list[str] = []
    lock = threading.Lock()

    def actor(number: int) -> None:
        client = ReplayClient(server.address, timeout=WAIT_LIMIT_S)
        try:
            for call in range(calls):
                client.insert("work", rows(list(range(call * per_call, (call + 1) * per_call)),
                                           number))
        except BaseException as exc:
            failures.append(f"actor {number}: {exc!r}")

    def learner() -> None:
        client = ReplayClient(server.address, timeout=WAIT_LIMIT_S)
        try:
            while True:
                with lock:
                    if sum(map(len, taken)) >= total:
                        return
                    got = client.sample("work", batch, wait=True)
                    taken.append(got.ids.tolist())
                    batches.append(got)
        except BaseException as exc:
            failures.append(f"learner: {exc!r}")

    threads = [threading.Thread(target=actor, args=(n,)) for n in range(actors)]
    threads += [threading.Thread(target=learner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_LIMIT_S)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads)
    ids = [i for ids in taken for i in ids]
    assert len(ids) == total and len(set(ids)) == total  # every row once
    assert ids == sorted(ids)  # oldest first, across batches and learners
    for number in range(actors):  # each actor's rows come out in the order it sent them
        values = [int(v) for b in batches for v, a in zip(b.data["value"], b.data["actor"])
                  if int(a) == number]
        assert values == sorted(values) and len(values) == calls * per_call
    assert ReplayClient(server.address).info()["work"].size == 0


def test_a_stream_takes_the_queue_in_order(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    inserted = client.insert("ordered", rows(list(range(96)))).tolist()
    stream = client.stream("ordered", batch_size=8, prefetch=4, num_batches=12)
    seen = [i for b in stream for i in b.ids.tolist()]
    assert seen == inserted
    assert client.info()["ordered"].size == 0


def test_an_insert_past_max_size_waits_until_its_deadline_and_stores_nothing(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    first = client.insert("bounded", rows(list(range(10))))
    with pytest.raises(errors.DeadlineExceededError):
        ReplayClient(server.address, timeout=1.0).insert("bounded", rows([10]))
    assert client.info()["bounded"].size == 10
    assert client.sample("bounded", 4).ids.tolist() == first[:4].tolist()
    # A waiting insert goes in once a sample or a delete makes room.
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(
        ReplayClient(server.address, timeout=WAIT_LIMIT_S).insert("bounded", rows([20, 21, 22,
                                                                                    23, 24]))))
    waiting.start()
    assert wait_for(lambda: client.info()["bounded"].rate_limiter["blocked_inserts"] == 1,
                    WAIT_LIMIT_S)
    assert client.delete("bounded", first[4:5]) == 1
    waiting.join(timeout=WAIT_LIMIT_S)
    assert result and client.info()["bounded"].size == 10
    batch = client.sample("bounded", 10)
    assert batch.data["value"].tolist() == [5, 6, 7, 8, 9, 20, 21, 22, 23, 24]
    with pytest.raises(errors.InvalidArgumentError, match="max_size=10"):
        client.insert("bounded", rows(list(range(11))))


def test_a_stack_hands_out_the_newest_rows_first_and_deletes_skip_rows(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    ids = client.insert("stack", rows(list(range(6))))
    assert client.delete("stack", ids[[4, 1]]) == 2
    assert client.delete("stack", ids[[4]]) == 0  # already deleted: stale, ignored
    info = client.info()["stack"]
    assert info.size == 4 and info.sampler_stats["queue_depth"] == 4
    assert info.counters["deleted"] == 2
    assert client.sample("stack", 3).data["value"].tolist() == [5, 3, 2]
    with pytest.raises(errors.EmptyTableError):
        client.sample("stack", 2)  # one row left: a batch is never short
    with pytest.raises(errors.InvalidIdsError):
        client.delete("stack", torch.tensor([int(ids[-1]) + 1000]))
    with pytest.raises(errors.InvalidArgumentError, match="'fifo' or 'lifo', or max_times_sampled"):
        client.delete("plain", ids)
    assert client.info()["stack"].size == 1  # the refused calls removed nothing


def test_checkpoints_keep_the_queue_order(server_factory, tmp_path: Path) -> None:
    config = f"""
[server]
checkpoint_dir = "{tmp_path / 'ckpt'}"

[[tables]]
name = "q"
capacity = 64
sampler = "fifo"
"""
    first = server_factory(config)
    client = ReplayClient(first.address, timeout=30)
    ids = client.insert("q", rows(list(range(20))))
    client.sample("q", 3)
    client.delete("q", ids[[10, 11]])
    client.checkpoint()
    first.stop()
    again = server_factory(config)
    client = ReplayClient(again.address, timeout=30)
    assert client.info()["q"].size == 15
    assert client.sample("q", 15).data["value"].tolist() == [3, 4, 5, 6, 7, 8, 9, *range(12, 20)]
