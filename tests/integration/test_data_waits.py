"""Learners wait for data: sample(wait=True) and streams wait on the server while a table
cannot serve, time out cleanly, and keep waiting across a server restart."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from replay_client import ReplayClient, errors
from replay_server.app.embedded import EmbeddedServer
from replay_server.engine.config import TableConfig
from replay_server.errors import EmptyTableError
from replay_server.service.settings import ServerSettings
from tests.conftest import module_server, stays, wait_for

CONFIG = """
[[tables]]
name = "a"
capacity = 1000

[[tables]]
name = "b"
capacity = 1000

[[tables]]
name = "c"
capacity = 1000

[[tables]]
name = "d"
capacity = 1000

[[tables]]
name = "min10"
capacity = 1000
min_size_to_sample = 10
"""
JOIN_S = 30

served = module_server(CONFIG)


def rows(n: int, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n, 3), value)}


def blocked_samples(client: ReplayClient, table: str) -> int:
    return client.info()[table].rate_limiter["blocked_samples"]


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_sample_without_wait_on_an_empty_table_raises_empty_table(served) -> None:
    with pytest.raises(errors.EmptyTableError, match="'a'"):
        ReplayClient(served.address).sample("a", 4)


def test_sample_with_wait_blocks_until_rows_arrive(served) -> None:
    client = ReplayClient(served.address)
    client.reset("b")
    thread, out = in_thread(lambda: client.sample("b", 4, wait=True, timeout=JOIN_S))
    assert wait_for(lambda: blocked_samples(client, "b") == 1), "the sample never waited"
    assert stays(lambda: not out, 0.3), f"returned before any row existed: {out}"
    client.insert("b", rows(5, 7.0))
    thread.join(JOIN_S)
    assert out and not isinstance(out[0], BaseException), out
    assert (out[0].data["x"] == 7.0).all() and out[0].ids.shape == (4,)
    assert blocked_samples(client, "b") == 0


def test_sample_with_wait_times_out_cleanly_naming_the_table(served) -> None:
    client = ReplayClient(served.address)
    client.reset("c")
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="'c'.*waited for data"):
        client.sample("c", 4, wait=True, timeout=1.0)
    assert time.monotonic() - start < JOIN_S
    assert wait_for(lambda: blocked_samples(client, "c") == 0)
    client.insert("c", rows(2))  # the table is fine afterwards
    assert client.sample("c", 2).ids.shape == (2,)


def test_stream_waits_for_data_by_default(served) -> None:
    client = ReplayClient(served.address)
    client.reset("d")
    stream = client.stream("d", 4, prefetch=1)
    thread, out = in_thread(lambda: next(stream).data["x"].clone())
    try:
        assert wait_for(lambda: blocked_samples(client, "d") == 1), "the stream never waited"
        assert stays(lambda: not out, 0.3), f"the stream failed or returned: {out}"
        client.insert("d", rows(4, 3.0))
        thread.join(JOIN_S)
        assert out and not isinstance(out[0], BaseException), out
        assert (out[0] == 3.0).all()
    finally:
        stream.close()


def test_stream_waits_for_min_size_to_sample(served) -> None:
    client = ReplayClient(served.address)
    client.insert("min10", rows(5))
    stream = client.stream("min10", 2, prefetch=1)
    thread, out = in_thread(lambda: next(stream).ids.clone())
    try:
        assert wait_for(lambda: blocked_samples(client, "min10") == 1)
        client.insert("min10", rows(5))
        thread.join(JOIN_S)
        assert out and not isinstance(out[0], BaseException), out
    finally:
        stream.close()


def test_stream_wait_timeout_ends_the_stream_with_deadline_exceeded(served) -> None:
    client = ReplayClient(served.address)
    client.reset("a")
    stream = client.stream("a", 4, wait_timeout=1.0)
    with pytest.raises(errors.DeadlineExceededError, match="'a'"):
        next(stream)
    assert wait_for(lambda: blocked_samples(client, "a") == 0)


def test_stream_without_wait_ends_with_empty_table(served) -> None:
    client = ReplayClient(served.address)
    client.reset("a")
    with pytest.raises(errors.EmptyTableError):
        next(client.stream("a", 4, wait=False))


def test_bad_wait_timeout_is_refused_before_any_call(served) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="wait_timeout"):
        ReplayClient(served.address).stream("a", 4, wait_timeout=0)


def test_stream_keeps_waiting_across_a_server_restart(server_factory) -> None:
    first = server_factory(CONFIG)
    client = ReplayClient(first.address, max_retry_s=60)
    client.insert("a", rows(8, 1.0))
    stream = client.stream("a", 4, prefetch=1)
    assert (next(stream).data["x"] == 1.0).all()
    first.stop()  # no checkpoint: the restarted server's table is empty
    second = server_factory(CONFIG, port=first.port)
    taken: list = []

    def consume() -> None:  # the first server's batch in the window comes first, then 2.0s
        try:
            while not taken or not (taken[-1] == 2.0).all():
                taken.append(next(stream).data["x"].clone())
        except BaseException as exc:
            taken.append(exc)

    def failed() -> bool:
        return any(isinstance(t, BaseException) for t in taken)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    try:
        fresh = ReplayClient(second.address)
        assert wait_for(lambda: blocked_samples(fresh, "a") == 1, 40), (
            f"the stream did not come back and wait: {taken}")
        assert stays(lambda: not failed(), 0.3), f"the stream died instead of waiting: {taken}"
        fresh.insert("a", rows(4, 2.0))
        thread.join(JOIN_S)
        assert not thread.is_alive() and not failed(), taken
        assert (taken[-1] == 2.0).all() and len(taken) <= 2
        assert stream.stats.reconnects == 1
    finally:
        stream.close()


def test_embedded_stream_waits_for_data_too() -> None:
    settings = ServerSettings(tables=(TableConfig(name="e", capacity=100),))
    server = EmbeddedServer(settings, listen=False)
    stream = server.stream("e", 2, prefetch=1)
    thread, out = in_thread(lambda: next(stream).ids.clone())
    try:
        assert wait_for(lambda: server.tables["e"].changes.waiters == 1)
        server.tables["e"].insert(rows(3))
        thread.join(JOIN_S)
        assert out and not isinstance(out[0], BaseException), out
    finally:
        stream.close()
    server.tables["e"].reset()
    with pytest.raises(EmptyTableError, match="'e'"):
        next(server.stream("e", 2, wait=False))
