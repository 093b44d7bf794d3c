"""Priority updates ride on a stream's credits: the batch the next credit allows sees them.

With ``prefetch=1`` the learner holds batch ``j`` while batch ``j + 1`` is drawn
already; an update made then travels in the message of the credit that the
next ``next()`` grants, which allows batch ``j + 2``. Each step below gives all
the table's priority to one row (a different row each step), so every row
of batch ``j + 2`` must be that step's row, or the next step's (the credit
leaves on the stream's own thread, which may send it only once the learner
made its next update, with it), never an older one. Were the update sent
after the credit (or on another call), the server would draw batch ``j + 2``
before applying it, with the previous step's row. The deterministic version
holds the update inside the server's table and checks that the credit after
it draws nothing meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import threading

import grpc
import numpy as np
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_server.app.embedded import EmbeddedServer
from replay_server.engine.config import TableConfig
from replay_server.service.settings import ServerSettings
from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import module_server, stays, wait_for

ROWS = 64
STEPS = 30
CONFIG = """
[[tables]]
name = "prio"
capacity = 1000
sampler = "prioritized"
alpha = 1.0

[[tables]]
name = "gated"
capacity = 1000
sampler = "prioritized"
min_size_to_sample = 1000
"""

served = module_server(CONFIG)


def one_row_at_a_time(stream, ids: torch.Tensor, keys_of) -> list[tuple[int, int, list[int]]]:
    """Take ``STEPS`` batches, moving all priority to one row after each; the rows of the batch
    two steps later, with the rows it may be (that step's, or the next's)."""
    batches = [keys_of(next(stream))]
    targets = []
    for step in range(STEPS):
        target = (7 * step) % ROWS
        priorities = torch.zeros(ROWS, dtype=torch.float64)
        priorities[target] = 1.0
        stream.update_priorities(ids, priorities)
        targets.append(target)
        batches.append(keys_of(next(stream)))
    # batch j + 2 (the second after the update of step j) holds only step j's row (or j + 1's)
    return [(targets[j], targets[j + 1], batches[j + 2]) for j in range(STEPS - 1)]


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_the_batch_after_an_update_never_sees_the_old_priority(served, shared_memory) -> None:
    client = ReplayClient(served.address)
    client.reset("prio")
    ids = client.insert("prio", {"key": torch.arange(ROWS)})
    before = client.info()["prio"].counters["priority_updates"]
    stream = client.stream("prio", 16, prefetch=1, batches_per_message=1,
                           shared_memory=shared_memory)
    with stream:
        seen = one_row_at_a_time(stream, ids, lambda b: b.data["key"].tolist())
        assert stream.transport == ("shared_memory" if shared_memory else "grpc")
    for target, newer, keys in seen:
        assert keys in ([target] * 16, [newer] * 16), (target, newer, keys)
    # the last update rode on the last credit: the server applies it in its engine pool,
    # possibly after the stream closed here, so wait for it to land (a lost one never does)
    def applied() -> int:
        return client.info()["prio"].counters["priority_updates"] - before

    wait_for(lambda: applied() >= STEPS * ROWS)
    assert applied() == STEPS * ROWS  # every update applied, once


class HeldUpdates:
    """An embedded server (real gRPC port) whose table ``prio`` holds each priority update in
    the engine until :attr:`release` is set; :attr:`entered`: one arrived there."""

    def __init__(self) -> None:
        settings = ServerSettings(address="127.0.0.1:0", tables=(
            TableConfig(name="prio", capacity=100, sampler="prioritized"),))
        self.server = EmbeddedServer(settings)
        self.table = self.server.tables["prio"]
        self.ids = self.table.insert({"key": torch.arange(10)})
        self.entered, self.release = threading.Event(), threading.Event()
        apply = self.table.update_priorities

        def held(*args, **kwargs):
            self.entered.set()
            self.release.wait(30)
            return apply(*args, **kwargs)

        self.table.update_priorities = held  # type: ignore[method-assign]

    def __enter__(self) -> HeldUpdates:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.__exit__(*exc)

    def counter(self, name: str) -> int:
        return getattr(self.table.info().counters, name)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_no_batch_is_drawn_until_the_update_sent_before_its_credit_is_applied(
        shared_memory) -> None:
    """Deterministic: the server's update is held in the engine; the credit that followed it
    must not let a batch be drawn meanwhile (it would, were the credit counted first, or the
    update sent after it or on another call)."""
    with HeldUpdates() as held, ReplayClient(held.server.address) as client:
        with client.stream("prio", 4, prefetch=1, batches_per_message=1,
                           shared_memory=shared_memory) as stream:
            next(stream)  # the learner holds batch 0; batch 1 is drawn
            assert wait_for(lambda: held.counter("sampled") == 2 * 4)
            stream.update_priorities(held.ids, torch.full((10,), 2.0))
            next(stream)  # takes batch 1: its credit, which allows batch 2, follows the update
            assert held.entered.wait(10), "the update never reached the table"
            assert stays(lambda: held.counter("sampled") == 2 * 4, seconds=0.5), \
                "drawn before the update"
            held.release.set()
            assert wait_for(lambda: held.counter("sampled") == 3 * 4)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_closing_a_stream_right_after_an_update_loses_none_of_it(shared_memory) -> None:
    """Deterministic: the server is still applying the learner's previous update (held in the
    engine) when the learner makes its last one and closes the stream. The last update travels
    in the stream's final message, which the server reads only after the held one: closing
    waits for the server to end the call. Cancelling once the message was handed to gRPC
    dropped it unread (a CI run counted 1,856 of 1,920 updates applied)."""
    with HeldUpdates() as held, ReplayClient(held.server.address) as client:
        stream = client.stream("prio", 4, prefetch=1, batches_per_message=1,
                               shared_memory=shared_memory)
        next(stream)
        stream.update_priorities(held.ids, torch.full((10,), 2.0))
        next(stream)  # its credit carries the update: the server holds it in the engine
        assert held.entered.wait(10), "the update never reached the table"
        stream.update_priorities(held.ids[:3], torch.full((3,), 5.0))  # goes as it closes
        timer = threading.Timer(0.5, held.release.set)
        timer.start()
        stream.close()
        timer.join()
        assert wait_for(lambda: held.counter("priority_updates") >= 13, timeout=10)
        assert held.counter("priority_updates") == 13  # both applied, once


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_closing_a_stream_whose_draw_waits_ends_it_at_once_with_its_updates(
        served, shared_memory, caplog) -> None:
    """The server's draw waits (a rate limiter: fewer rows than min_size_to_sample) when the
    learner updates and closes: its last message says it leaves, so the server applies the
    update, drops the waiting draw and ends the call. Without it the server went on waiting,
    and closing cancelled the call after CLOSE_S, not knowing whether the update was read."""
    client = ReplayClient(served.address)
    client.reset("gated")
    ids = client.insert("gated", {"key": torch.arange(ROWS)})

    def gated() -> dict:
        return client.info()["gated"].counters | client.info()["gated"].rate_limiter

    before = gated()["priority_updates"]
    stream = client.stream("gated", 4, prefetch=1, batches_per_message=1,
                           shared_memory=shared_memory)
    assert wait_for(lambda: gated()["blocked_samples"] == 1), "the draw never waited"
    stream.update_priorities(ids, torch.full((ROWS,), 3.0))
    with caplog.at_level(logging.WARNING, logger="replay_client.stream"):
        stream.close()
    assert not [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
    assert gated()["priority_updates"] - before == ROWS
    assert wait_for(lambda: gated()["blocked_samples"] == 0)  # the draw stopped waiting
    client.close()


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_the_updates_of_a_bounded_streams_last_batches_are_applied(
        served, shared_memory) -> None:
    """A stream of ``num_batches``: the server has sent the last batch a window before the
    learner takes it. It ended the call then, and every update the learner made after was
    dropped unread (here 128 of 256 applied with the default window, none with a learner
    slower than the server). Now the call stays open until the learner leaves."""
    client = ReplayClient(served.address)
    client.reset("prio")
    client.insert("prio", {"key": torch.arange(ROWS)})
    before = client.info()["prio"].counters["priority_updates"]
    with client.stream("prio", 16, num_batches=6, prefetch=4,
                       shared_memory=shared_memory) as stream:
        for k, batch in enumerate(stream):
            if k == 0:  # the server sends what the window allows, and has all 6 out soon
                assert wait_for(lambda: client.info()["prio"].counters["sampled"] >= 5 * 16)
            stream.update_priorities(batch.ids, torch.full((16,), 2.0))
    assert client.info()["prio"].counters["priority_updates"] - before == 6 * 16
    client.close()


class RawLearner:
    """A learner speaking SampleStream's messages itself on a real gRPC port: it opens a
    stream of ``num_batches``, may send one update once it has the last batch, and neither
    says ``closing`` nor half-closes until :meth:`leave`."""

    def __init__(self, address: str, *, stays: bool, num_batches: int = 2) -> None:
        self.channel = grpc.insecure_channel(address)
        self._update: list[bytes] = []
        self._wake, self._left = threading.Event(), threading.Event()
        opening = pb.SampleStreamRequest(
            request=pb.SampleRequest(table="prio", batch_size=4, num_batches=num_batches),
            credits=num_batches, stays_until_closing=stays).SerializeToString()

        def requests():
            yield opening
            while not self._left.is_set():
                self._wake.wait(30)
                self._wake.clear()
                while self._update:
                    yield self._update.pop()

        call = self.channel.stream_stream("/replay.v1.ReplayService/SampleStream")
        self.call = call(requests())
        self.answers = iter(self.call)

    def update(self, ids: torch.Tensor, priority: float) -> None:
        self._update.append(messages.encode_credit(0, messages.encode_update(
            "prio", ids.numpy(), np.full(len(ids), priority))))
        self._wake.set()

    def leave(self) -> None:
        self._left.set()
        self._wake.set()
        self.channel.close()


def test_a_bounded_stream_waits_for_a_learner_that_said_it_closes_at_most_response_timeout(
        ) -> None:
    """With ``stays_until_closing`` the call stays open after the last batch: an update sent
    then is applied; a learner that never leaves is let go after server.response_timeout_s
    (OK: it had every batch). Without it (a raw client, an older one) the call ends with the
    last batch, as it always did, whether or not the client half-closed."""
    settings = ServerSettings(address="127.0.0.1:0", response_timeout_s=1.0, tables=(
        TableConfig(name="prio", capacity=100, sampler="prioritized"),))
    with EmbeddedServer(settings) as server:
        table = server.tables["prio"]
        ids = table.insert({"key": torch.arange(10)})
        staying = RawLearner(server.address, stays=True)
        try:
            assert len(list(itertools.islice(staying.answers, 2))) == 2  # both batches
            staying.update(ids[:3], 7.0)
            assert wait_for(lambda: table.info().counters.priority_updates == 3)
            assert list(staying.answers) == []  # then it ends, after response_timeout_s
            assert staying.call.code() == grpc.StatusCode.OK
        finally:
            staying.leave()
        leaving = RawLearner(server.address, stays=False)
        try:
            assert len(list(leaving.answers)) == 2  # the call ends with the last batch
            assert leaving.call.code() == grpc.StatusCode.OK
        finally:
            leaving.leave()


def test_the_embedded_stream_applies_updates_before_its_next_draw() -> None:
    settings = ServerSettings(tables=(TableConfig(name="prio", capacity=1000,
                                                  sampler="prioritized", alpha=1.0),))
    server = EmbeddedServer(settings, listen=False)
    ids = server.tables["prio"].insert({"key": torch.arange(ROWS)})
    with server.stream("prio", 16, prefetch=1) as stream:
        seen = one_row_at_a_time(stream, ids, lambda b: b.data["key"].tolist())
    for target, newer, keys in seen:
        assert keys in ([target] * 16, [newer] * 16), (target, newer, keys)


def test_the_embedded_stream_applies_the_updates_of_its_last_batches() -> None:
    """In process too: the link stopped reading the learner's grants with its last batch, a
    window before the learner took it (80 of 96 applied here)."""
    settings = ServerSettings(tables=(TableConfig(name="prio", capacity=1000,
                                                  sampler="prioritized"),))
    server = EmbeddedServer(settings, listen=False)
    table = server.tables["prio"]
    table.insert({"key": torch.arange(ROWS)})
    with server.stream("prio", 16, num_batches=6, prefetch=4) as stream:
        for k, batch in enumerate(stream):
            if k == 0:  # every batch the window allows is drawn before the first update
                assert wait_for(lambda: table.info().counters.sampled >= 5 * 16)
            stream.update_priorities(batch.ids, torch.full((16,), 2.0))
    assert table.info().counters.priority_updates == 6 * 16


def test_large_updates_travel_in_parts_before_their_credit(served) -> None:
    """An update of more ids than one credit message holds is split; all parts go first."""
    client = ReplayClient(served.address)
    client.reset("prio")
    ids = client.insert("prio", {"key": torch.arange(ROWS)})
    many = ids.repeat(300)  # 19,200 ids: several messages
    with client.stream("prio", 8, prefetch=1, batches_per_message=1) as stream:
        next(stream)
        priorities = torch.zeros(len(many), dtype=torch.float64)
        priorities[-ROWS:][5] = 1.0  # the last part decides: row 5 alone keeps priority
        stream.update_priorities(many, priorities)
        next(stream)
        assert next(stream).data["key"].tolist() == [5] * 8


def test_bad_updates_are_refused_before_anything_is_queued_or_end_the_stream_typed(
        served) -> None:
    client = ReplayClient(served.address)
    client.reset("prio")
    ids = client.insert("prio", {"key": torch.arange(ROWS)})
    before = client.info()["prio"].counters["priority_updates"]
    stream = client.stream("prio", 8, prefetch=1, batches_per_message=1)
    with stream:
        next(stream)
        with pytest.raises(errors.InvalidPriorityError, match="finite and >= 0"):
            stream.update_priorities(ids, torch.full((ROWS,), -1.0))
        with pytest.raises(errors.InvalidIdsError, match="int64"):
            stream.update_priorities(ids.int(), torch.ones(ROWS))
        # not an id (negative): checked by the server, which ends the stream with its error
        stream.update_priorities(torch.tensor([-5]), torch.ones(1))
        with pytest.raises(errors.InvalidIdsError):
            for _ in range(10):
                next(stream)
    assert client.info()["prio"].counters["priority_updates"] == before  # nothing applied
