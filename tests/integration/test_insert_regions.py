"""Large inserts from the server's host through a shared-memory region of the call stream.

An insert of 64 KiB to 64 MiB from a client on the server's host is written
into a region in /dev/shm that the server made for the client's insert
stream, and the stream carries only its length: the same ids and bytes as
the chunked call, a fraction of the copies. Where a region cannot be had
(shared memory off on the server, over its budget, another host,
``REPLAY_SHARED_MEMORY=0``) the insert goes chunked as before, and a
malformed or out-of-bounds request in a region is refused with nothing
stored. Real server processes; regions live in a directory of the test's
own (``REPLAY_SHM_DIR``), so nothing else on the host is touched and the
test can see that no name is left behind.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from replay_client import ReplayClient, call_stream, errors
from replay_feed.shared_ring import SharedRing, host_id
from replay_proto import messages
from replay_proto.codec import frame
from replay_proto.v1 import replay_pb2 as pb
from tests.client.test_call_stream_inserts import _stand_in
from tests.conftest import ServerProcess, start_server, wait_for

CONFIG = """
[server]
shared_memory_mb = {mb}
shared_memory = {on}

[[tables]]
name = "frames"
capacity = 2000
"""


def _server(tmp_path_factory, shm: Path, mb: int = 64, on: str = "true") -> ServerProcess:
    return start_server(tmp_path_factory.mktemp("server"), CONFIG.format(mb=mb, on=on),
                        env={"REPLAY_SHM_DIR": str(shm)})


@pytest.fixture(scope="module")
def shm(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def server(tmp_path_factory, shm: Path) -> Iterator[ServerProcess]:
    proc = _server(tmp_path_factory, shm)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess, shm: Path, monkeypatch) -> Iterator[ReplayClient]:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm))
    client = ReplayClient(server.address)
    yield client
    client.close()


def _frames(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {"frame": torch.from_numpy(rng.integers(0, 256, (rows, 84, 84), dtype=np.uint8)),
            "step": torch.arange(rows) + 1000 * seed}


def _in_use(client: ReplayClient) -> int:
    return client.server_info().limits["shared_memory_in_use_bytes"]


def test_a_large_insert_goes_through_the_region_with_the_same_ids_and_bytes(
        client: ReplayClient, shm: Path) -> None:
    first = client.insert("frames", _frames(1))  # 452 KB: over the stream's 64 KiB messages
    session = client._stream("insert")._session
    assert session is not None and session.region is not None
    assert session.sequence == 3  # insert_region, region_answer, insert_in_region
    assert os.listdir(shm) == []  # both sides mapped it: the name is gone already
    assert _in_use(client) >= session.region.slot_bytes  # counted in shared_memory_mb
    second = client.insert("frames", _frames(2))
    assert session.sequence == 4  # the same region again: one message
    ids = torch.cat([first, second])
    assert ids.tolist() == list(range(int(ids[0]), int(ids[0]) + 128))
    read = client.read("frames", ids=ids)
    expected = [_frames(1), _frames(2)]
    assert torch.equal(read.columns["frame"], torch.cat([e["frame"] for e in expected]))
    assert torch.equal(read.columns["step"], torch.cat([e["step"] for e in expected]))
    larger = client.insert("frames", _frames(3, rows=1500))  # 10.6 MB: a larger region
    assert session.sequence == 7 and session.region.slot_bytes >= 16 << 20
    assert torch.equal(client.read("frames", ids=larger).columns["frame"],
                       _frames(3, rows=1500)["frame"])


def test_the_region_is_released_when_the_stream_ends(server: ServerProcess, shm: Path,
                                                     monkeypatch) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm))
    watcher = ReplayClient(server.address)
    client = ReplayClient(server.address)
    client.insert("frames", _frames(4))
    assert _in_use(watcher) > 0
    client.close()
    assert wait_for(lambda: _in_use(watcher) == 0)
    assert os.listdir(shm) == []
    watcher.close()


@pytest.mark.parametrize("why", ["server off", "over budget", "another host", "client off"])
def test_without_a_region_a_large_insert_goes_chunked(tmp_path_factory, shm: Path,
                                                      monkeypatch, why: str) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm))
    proc = _server(tmp_path_factory, shm, mb=4 if why == "over budget" else 64,
                   on="false" if why == "server off" else "true")
    if why == "another host":
        monkeypatch.setattr(call_stream, "host_id", lambda: "another-host")
    if why == "client off":
        monkeypatch.setenv("REPLAY_SHARED_MEMORY", "0")
    client = ReplayClient(proc.address)
    try:
        ids = [client.insert("frames", _frames(k, rows=128)) for k in range(3)]  # 903 KB each
        stream = client._stream("insert")
        session = stream._session
        assert session is None or session.region is None
        said = {"server off": "shared_memory = false", "over budget": "shared_memory_mb",
                "another host": "another host", "client off": "REPLAY_SHARED_MEMORY=0"}[why]
        reason = stream._no_regions or (session.no_region if session is not None else "")
        assert said in reason, reason
        if session is not None:
            assert session.sequence == 1  # asked once on this call, never again
        read = client.read("frames", ids=torch.cat(ids))
        assert torch.equal(read.columns["frame"],
                           torch.cat([_frames(k, rows=128)["frame"] for k in range(3)]))
        assert _in_use(client) == 0 and os.listdir(shm) == []
    finally:
        client.close()
        proc.stop()


class RawStream:
    """A CallStream call driven message by message (what a misbehaving client sends)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.sequence = 0
        call = self.channel.stream_stream(
            "/replay.v1.ReplayService/CallStream",
            request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        self.answers = call(iter(self.outgoing.get, None))

    def ask(self, kind: str, message: bytes | int) -> pb.CallStreamResponse:
        if kind == "insert_in_region":
            raw = messages.encode_region_insert(self.sequence, int(message))
        else:
            assert isinstance(message, bytes)
            raw = messages.encode_call_request(self.sequence, kind, message)
        self.sequence += 1
        self.outgoing.put(raw)
        answer = pb.CallStreamResponse.FromString(next(self.answers))
        assert answer.sequence == self.sequence - 1
        return answer

    def close(self) -> None:
        self.outgoing.put(None)
        self.channel.close()


def test_bad_region_requests_are_refused_in_band_storing_nothing(
        client: ReplayClient, server: ServerProcess) -> None:
    before = client.info()["frames"].size
    raw = RawStream(server.address)
    try:
        answer = raw.ask("insert_in_region", 1000)  # no region yet
        assert answer.error.code == "INVALID_ARGUMENT" and "without a region" in answer.error.message
        answer = raw.ask("region_answer", pb.SharedMemoryAnswer(accepted=True).SerializeToString())
        assert answer.error.code == "INVALID_ARGUMENT"
        huge = pb.SharedInsertRegion(host_id=host_id(), bytes=1 << 40).SerializeToString()
        assert raw.ask("insert_region", huge).error.code == "RESOURCE_EXHAUSTED"
        ask = pb.SharedInsertRegion(host_id=host_id(), bytes=1 << 20).SerializeToString()
        offer = raw.ask("insert_region", ask).region_offer
        region = SharedRing.open(offer.name, offer.token, offer.slots, offer.slot_bytes,
                                 offer.header_bytes)
        said = raw.ask("region_answer", pb.SharedMemoryAnswer(accepted=True).SerializeToString())
        assert said.region_answer.accepted
        answer = raw.ask("insert_in_region", region.slot_bytes + 1)  # past the region
        assert answer.error.code == "INVALID_ARGUMENT" and "do not fit" in answer.error.message
        region.slot(0)[:4096] = torch.randint(0, 256, (4096,), dtype=torch.uint8)  # garbage
        assert raw.ask("insert_in_region", 4096).error.code == "INVALID_ARGUMENT"
        assert client.info()["frames"].size == before  # nothing of any of them stored
        good = frame(*messages.insert_parts("frames", _frames(9, rows=2)))
        region.slot(0)[:len(good)] = torch.frombuffer(bytearray(good), dtype=torch.uint8)
        answer = raw.ask("insert_in_region", len(good))  # the stream went on
        assert answer.insert.count == 2 and client.info()["frames"].size == before + 2
        region.close()
    finally:
        raw.close()


def test_a_server_without_regions_leaves_small_inserts_on_the_stream() -> None:
    """A server from before regions ends the call at an ``insert_region`` it cannot decode
    (INVALID_ARGUMENT): the large insert goes chunked, regions are not asked for again, and
    small inserts stay on the stream (no 30 s of unary calls for a refusal)."""
    seen: list[str] = []

    def old_server(requests, context):
        for raw in requests:
            request = pb.CallStreamRequest.FromString(raw)
            kind = request.WhichOneof("call")
            seen.append(str(kind))
            if kind != "insert":  # what an old server's decoder makes of the new fields
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed CallStreamRequest")
            yield pb.CallStreamResponse(sequence=request.sequence, insert=pb.InsertResponse(
                first_id=7, count=1)).SerializeToString()

    stand_in, port, unary = _stand_in(old_server)
    client = ReplayClient(f"127.0.0.1:{port}")
    try:
        assert client.insert("t", {"x": torch.zeros(20_000)}).tolist()  # 80 KB: chunked
        assert unary == ["t"] and seen == ["insert_region"]
        assert client.insert("t", {"x": torch.zeros(20_000)}).tolist()
        assert unary == ["t", "t"] and seen == ["insert_region"]  # not asked again
        assert client.insert("t", {"x": torch.zeros(1)}).tolist() == [7]  # on the stream
        assert seen == ["insert_region", "insert"]
    finally:
        client.close()
        stand_in.stop(None)


def test_an_insert_that_fails_through_the_region_raises_its_type(client: ReplayClient) -> None:
    client.insert("frames", _frames(5))
    with pytest.raises(errors.SchemaMismatchError):
        client.insert("frames", {"frame": torch.zeros(64, 84, 84, dtype=torch.uint8)})
    assert client._stream("insert")._session.region is not None  # refused, stream goes on
