"""Rate limiting through a real server: blocked calls wait without a thread, time out
with DEADLINE_EXCEEDED, the ratio holds under concurrent actors and a learner, and
info shows the limiter's state.

One server (2 engine threads) serves the module; each test uses its own tables.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto.v1 import replay_pb2 as pb
from replay_proto.v1 import replay_pb2_grpc
from replay_server.app.info_table import format_info
from tests.conftest import module_server, wait_for

WORKERS = 2
WAITERS = 8  # more blocked calls than engine threads
WAIT_LIMIT_S = 60

CONFIG = f"""
[server]
workers = {WORKERS}

[[tables]]
name = "gate"
capacity = 1000
min_size_to_sample = 100

[[tables]]
name = "never_filled"
capacity = 100
min_size_to_sample = 10

[[tables]]
name = "full"
capacity = 1000
sampler = "prioritized"
min_size_to_sample = 5
samples_per_insert = 1.0
error_buffer = 1.0

[[tables]]
name = "ratio"
capacity = 100000
sampler = "prioritized"
min_size_to_sample = 200
samples_per_insert = 2.0
error_buffer = 100.0

[[tables]]
name = "stream"
capacity = 1000
min_size_to_sample = 50

[[tables]]
name = "once"
capacity = 100
max_times_sampled = 1

[[tables]]
name = "shown"
capacity = 100
sampler = "prioritized"
min_size_to_sample = 3
samples_per_insert = 1.5
error_buffer = 4.0
max_times_sampled = 2
"""

server = module_server(CONFIG)


def rows(n: int, first: int = 0) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(first, first + n, dtype=torch.float32).unsqueeze(1)}


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (bounded in time); fail the test naming ``what`` if it never holds."""
    if not wait_for(condition, WAIT_LIMIT_S):
        raise AssertionError(f"gave up waiting for {what}")


def limiter(client: ReplayClient, table: str) -> dict:
    return client.info()[table].rate_limiter


def test_blocked_samplers_hold_no_thread_and_get_their_batches_after_inserts(server) -> None:
    client = ReplayClient(server.address, timeout=120)
    results: list = []

    def sampler() -> None:
        try:
            results.append(client.sample("gate", 16))
        except BaseException as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=sampler) for _ in range(WAITERS)]
    for thread in threads:
        thread.start()
    wait_until(lambda: limiter(client, "gate")["blocked_samples"] == WAITERS,
               f"{WAITERS} blocked samples")
    # With every waiter parked on the event loop, inserts still run (2 engine threads).
    inserter = ReplayClient(server.address, timeout=30)
    issued: set[int] = set()
    for start in range(0, 100, 25):
        issued.update(inserter.insert("gate", rows(25, start)).tolist())
    for thread in threads:
        thread.join(timeout=WAIT_LIMIT_S)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == WAITERS
    for batch in results:
        assert not isinstance(batch, BaseException), repr(batch)
        assert batch.ids.shape == (16,) and set(batch.ids.tolist()) <= issued
    state = limiter(client, "gate")
    assert (state["blocked_samples"], state["inserts"], state["samples"]) == (0, 100, 16 * WAITERS)


def test_sample_with_a_short_timeout_raises_deadline_exceeded(server) -> None:
    client = ReplayClient(server.address, timeout=1.0)
    with pytest.raises(errors.DeadlineExceededError) as info:
        client.sample("never_filled", 4)
    assert isinstance(info.value, TimeoutError)
    after = ReplayClient(server.address, timeout=30)
    wait_until(lambda: limiter(after, "never_filled")["blocked_samples"] == 0, "no waiter")
    assert limiter(after, "never_filled")["samples"] == 0


def test_insert_ahead_of_the_learner_times_out_and_stores_nothing(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    first = client.insert("full", rows(6))  # filling up: free; the count is now at its top
    blocked = ReplayClient(server.address, timeout=1.0)
    with pytest.raises(errors.DeadlineExceededError):
        blocked.insert("full", rows(1, 6))
    assert client.info()["full"].size == 6
    client.sample("full", 2)                # the learner catches up: inserts pass again
    assert client.insert("full", rows(1, 6)).tolist() == [int(first[-1]) + 1]  # the refused
    # insert was never issued an id


def test_ratio_holds_within_the_error_buffer_under_concurrent_actors_and_a_learner(server):
    actors, calls, rows_per_call, batch_size = 3, 120, 10, 32
    spi, min_size, buffer = 2.0, 200, 100.0
    min_diff, max_diff = spi * min_size - buffer, spi * min_size + buffer
    failures: list[str] = []
    snapshots: list[dict] = []
    done = threading.Event()

    def actor(number: int) -> None:
        client = ReplayClient(server.address, timeout=WAIT_LIMIT_S)
        try:
            for call in range(calls):
                client.insert("ratio", rows(rows_per_call, (number * calls + call) * 100))
        except BaseException as exc:
            failures.append(f"actor {number}: {exc!r}")

    def learner() -> None:
        client = ReplayClient(server.address, timeout=5)
        while not done.is_set():
            try:
                batch = client.sample("ratio", batch_size)
                client.update_priorities("ratio", batch.ids, torch.rand(batch_size) + 0.1)
            except errors.DeadlineExceededError:
                continue  # held back while the actors are held back too: only at the end
            except BaseException as exc:
                failures.append(f"learner: {exc!r}")
                return

    def monitor() -> None:
        client = ReplayClient(server.address, timeout=30)
        while not done.is_set():
            snapshots.append(limiter(client, "ratio"))
            time.sleep(0.01)

    threads = [threading.Thread(target=actor, args=(n,)) for n in range(actors)]
    helpers = [threading.Thread(target=learner), threading.Thread(target=monitor)]
    for thread in threads + helpers:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    done.set()
    for thread in helpers:
        thread.join(timeout=WAIT_LIMIT_S)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads + helpers)

    final = limiter(ReplayClient(server.address, timeout=30), "ratio")
    assert final["inserts"] == actors * calls * rows_per_call
    assert final["samples"] > 0
    for state in [*snapshots, final]:
        count = state["inserts"] * spi - state["samples"]
        # A call is admitted by its first row, so the count may leave the window by one call.
        assert count <= max_diff + (rows_per_call - 1) * spi, state
        if state["samples"]:
            assert count >= min_diff - (batch_size - 1), state
    assert len(snapshots) > 10


def test_stream_waits_per_batch_for_the_minimum_size(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    got: list = []

    def reader() -> None:
        try:
            got.extend(client.stream("stream", 8, num_batches=3, batches_per_message=2))
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until(lambda: limiter(client, "stream")["blocked_samples"] >= 1, "a blocked stream")
    client.insert("stream", rows(50))
    thread.join(timeout=WAIT_LIMIT_S)
    assert not thread.is_alive()
    assert len(got) == 3, got
    assert all(not isinstance(b, BaseException) and b.ids.shape == (8,) for b in got), got


def test_max_times_sampled_1_returns_every_row_once_over_the_wire(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    ids = client.insert("once", rows(10))
    batch = client.sample("once", 10)
    assert sorted(batch.ids.tolist()) == ids.tolist()
    info = client.info()["once"]
    assert (info.size, info.counters["retired"], info.max_times_sampled) == (0, 10, 1)
    with pytest.raises(errors.EmptyTableError, match="needs more draws"):
        client.sample("once", 1)


def test_info_shows_the_limiter_settings_and_state(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    client.insert("shown", rows(4))
    client.sample("shown", 1)  # one draw: never retires a row (max_times_sampled = 2)
    info = client.info()["shown"]
    state = info.rate_limiter
    assert (state["enabled"], state["min_size_to_sample"], state["samples_per_insert"],
            state["error_buffer"], state["min_diff"], state["max_diff"]) == (
        True, 3, 1.5, 4.0, 0.5, 8.5)
    assert (state["inserts"], state["samples"], state["deletes"]) == (4, 1, 0)
    assert (state["can_insert"], state["can_sample"]) == (True, True)
    assert (state["blocked_inserts"], state["blocked_samples"]) == (0, 0)
    assert info.max_times_sampled == 2
    plain = client.info()["never_filled"].rate_limiter
    assert (plain["samples_per_insert"], plain["max_diff"]) == (0.0, float("inf"))

    response = pb.InfoResponse(tables=[
        pb.TableInfo(name="shown", sampler="prioritized", capacity=100, size=4,
                     rate_limiter=pb.RateLimiterInfo(**state), max_times_sampled=2),
    ])
    text = format_info(response)
    assert ("shown flow control: min_size_to_sample=3 samples_per_insert=1.5 error_buffer=4; "
            "inserts=4 samples=1 deletes=0; inserts pass, samples pass; waiting now: 0 inserts, "
            "0 samples; max_times_sampled=2") in text, text


def test_cancelled_waiting_calls_stop_waiting(server) -> None:
    client = ReplayClient(server.address, timeout=30)
    with grpc.insecure_channel(server.address) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        request = pb.SampleRequest(table="never_filled", batch_size=2)
        unary = stub.Sample.future(request)                      # no deadline: waits until...
        stream = stub.SampleStream(iter([pb.SampleStreamRequest(request=request, credits=2)]))
        wait_until(lambda: limiter(client, "never_filled")["blocked_samples"] == 2,
                   "a waiting Sample and a waiting SampleStream")
        unary.cancel()                                           # ... the client cancels
        stream.cancel()
        wait_until(lambda: limiter(client, "never_filled")["blocked_samples"] == 0,
                   "the cancelled calls to stop waiting")
    assert limiter(client, "never_filled")["samples"] == 0


def test_waiting_calls_end_with_unavailable_when_the_server_drains(server_factory) -> None:
    server = server_factory(CONFIG)
    client = ReplayClient(server.address, timeout=WAIT_LIMIT_S, max_retry_s=0.0)
    got: list = []

    def sampler() -> None:
        try:
            got.append(client.sample("never_filled", 2))
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=sampler)
    thread.start()
    wait_until(lambda: limiter(client, "never_filled")["blocked_samples"] == 1, "a waiter")
    assert server.stop() == 0
    thread.join(timeout=WAIT_LIMIT_S)
    assert len(got) == 1 and isinstance(got[0], errors.UnavailableError), got
    assert "shutting down" in str(got[0]), got
