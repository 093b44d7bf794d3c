"""A contributor's check: a transport defined and registered here, in the test package, with no
product file edited. Its server side (a sink) puts each drawn batch in an in-process queue and
sends only the batch's index; its learner side (a source) takes the batch from the queue. The
stream opens over gRPC, the server offers the queue with the first batch, the learner accepts,
and every later batch travels through it, with the credits, priority updates and leases of any
stream. A real embedded server on 127.0.0.1 (port 0) and a real client stream over its socket.
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Any

import pytest
import torch

from replay_client import ReplayClient
from replay_client import sources as source_registry
from replay_client.batch_source import Opened, SourceContext, transport_answer, transport_offer
from replay_proto.batch import SampleBatch
from replay_proto.codec import CodecError
from replay_proto.v1 import replay_pb2 as pb
from replay_server.app.embedded import EmbeddedServer
from replay_server.engine.config import TableConfig
from replay_server.service import batch_sink
from replay_server.service import sinks as sink_registry
from replay_server.service.settings import ServerSettings
from tests.conftest import wait_for

NAME = "queue"
_QUEUES: dict[bytes, queue.SimpleQueue] = {}
"""Each stream's queue, by the token its offer carries (server and learner share this process)."""
_LOCK = threading.Lock()


class QueueSink:
    """The server's side: batch ``k`` into the stream's queue, its index in the message."""

    name = NAME

    def __init__(self) -> None:
        self.token = uuid.uuid4().bytes
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.sent = 0

    def group(self, wanted: int, batch_size: int, batch_bytes: int) -> int:
        return 1

    def held_bytes(self, count: int, batch_bytes: int, extras: int) -> int:
        return count * batch_bytes + extras

    def send(self, draw: batch_sink.Draw, index: int,
             count: int) -> tuple[list[bytes], int, SampleBatch]:
        batch, _ = draw(1)
        self.queue.put((index, batch))
        self.sent += 1
        header = pb.SampleResponse(batch_index=index, batch_rows=batch.batch_size,
                                   last_chunk=True, batch_count=1,
                                   transport_batch=index.to_bytes(8, "little"))
        return [header.SerializeToString()], 1, batch

    def offer(self, batch: SampleBatch, batch_size: int) -> tuple[bytes, str]:
        with _LOCK:
            _QUEUES[self.token] = self.queue
        return batch_sink.transport_offer(NAME, self.token), ""

    def answered(self, message: pb.SampleStreamRequest) -> bool | None:
        answer = batch_sink.transport_answer(NAME, message)
        if answer is None:
            return None
        if not answer.accepted:
            self.close()
        return answer.accepted

    def close(self) -> None:
        with _LOCK:
            _QUEUES.pop(self.token, None)


class QueueSinks:
    """The server's registry entry: a queue for every learner that asks for one."""

    name = NAME
    made: list[QueueSink] = []

    def open(self, context: batch_sink.SinkContext) -> tuple[QueueSink | None, str]:
        if NAME not in context.first.transports:
            return None, ""
        sink = QueueSink()
        self.made.append(sink)
        return sink, ""

    def prepare(self, settings: Any) -> None:
        pass


class QueueSource:
    """The learner's side: the batch the message names, from the queue."""

    name = NAME
    window_grows = True

    def __init__(self, batches: queue.SimpleQueue) -> None:
        self._batches = batches

    def batches(self, header: pb.SampleResponse, payload: memoryview) -> list[SampleBatch] | None:
        if not header.transport_batch:
            return None
        index, batch = self._batches.get(timeout=30)
        if index != int.from_bytes(header.transport_batch, "little"):
            raise CodecError(f"batch {index} in the queue, the message names another")
        return [batch]

    def close(self) -> None:
        pass


class QueueSources:
    """The learner's registry entry: asks for the queue on every call (it allows same-host)."""

    name = NAME
    title = "in-process queue"

    def ask(self, opening: pb.SampleStreamRequest, local: bool) -> bool:
        if local:
            opening.transports.append(NAME)
        return local

    def open(self, header: pb.SampleResponse, context: SourceContext) -> Opened | None:
        offer = transport_offer(NAME, header)
        if offer is None:
            return None
        if context.refusal:
            return Opened(None, transport_answer(NAME, False, context.refusal),
                          f"gRPC: {context.refusal}")
        with _LOCK:
            batches = _QUEUES.get(offer.params)
        if batches is None:
            return Opened(None, transport_answer(NAME, False, "not in this process"),
                          "gRPC: the queue is in another process")
        return Opened(QueueSource(batches), transport_answer(NAME, True), "queue: in process")


@pytest.fixture
def registered(monkeypatch):
    """The queue registered first on both sides (best first), as a product transport's line in
    ``sinks.py`` and ``sources.py`` would."""
    QueueSinks.made = []
    monkeypatch.setattr(sink_registry, "SINKS", {NAME: QueueSinks(), **sink_registry.SINKS})
    monkeypatch.setattr(source_registry, "SOURCES",
                        {NAME: QueueSources(), **source_registry.SOURCES})


@pytest.fixture
def server():
    settings = ServerSettings(address="127.0.0.1:0", tables=(
        TableConfig(name="prio", capacity=1000, sampler="prioritized"),))
    with EmbeddedServer(settings) as embedded:
        yield embedded


def test_a_transport_registered_from_the_tests_carries_the_stream(registered, server) -> None:
    issued = server.tables["prio"].insert({"row": torch.arange(100)})
    client = ReplayClient(server.address)
    try:
        stream = client.stream("prio", 8, num_batches=6, batches_per_message=1)
        with stream:
            batches = [(batch.data["row"].clone(), batch.ids.clone()) for batch in stream]
        assert stream.transport == NAME
        assert "queue: in process" in stream.stats.notes
        # Every batch whole and its own: its ids are those the rows were inserted with.
        assert len(batches) == 6
        assert all(torch.equal(issued[rows], ids) for rows, ids in batches)
        (sink,) = QueueSinks.made
        # The first batch brought the offer over gRPC, and so did those drawn before the
        # learner's answer came (its window's); the rest came through the queue.
        assert 1 <= sink.sent <= 5
        assert wait_for(lambda: not _QUEUES)  # the stream's queue goes with its call
    finally:
        client.close()


def test_priority_updates_ride_on_the_credits_of_the_new_transport(registered, server) -> None:
    table = server.tables["prio"]
    table.insert({"row": torch.arange(10)})
    client = ReplayClient(server.address)
    try:
        with client.stream("prio", 4, num_batches=3, batches_per_message=1) as stream:
            for batch in stream:
                stream.update_priorities(batch.ids, torch.full((4,), 5.0))
        assert stream.transport == NAME
        assert table.info().counters.priority_updates == 12
    finally:
        client.close()


def test_a_learner_that_cannot_take_the_offer_stays_on_grpc(registered, server,
                                                            monkeypatch) -> None:
    server.tables["prio"].insert({"row": torch.arange(50)})
    monkeypatch.setattr(QueueSources, "open", lambda self, header, context: (
        None if transport_offer(NAME, header) is None else
        Opened(None, transport_answer(NAME, False, "refused by the test"), "gRPC: refused")))
    client = ReplayClient(server.address)
    try:
        stream = client.stream("prio", 8, num_batches=4, batches_per_message=1)
        assert sum(1 for _ in stream) == 4
        assert stream.transport == "grpc"
        assert QueueSinks.made[0].sent == 0  # every batch over gRPC messages
        assert wait_for(lambda: not _QUEUES)  # the refused sink let go of its queue
    finally:
        client.close()


def test_without_the_registration_the_stream_is_the_ring_or_grpc(server) -> None:
    server.tables["prio"].insert({"row": torch.arange(50)})
    client = ReplayClient(server.address)
    try:
        stream = client.stream("prio", 8, num_batches=2, batches_per_message=1)
        assert sum(1 for _ in stream) == 2
        assert stream.transport in ("shared_memory", "grpc")
    finally:
        client.close()
