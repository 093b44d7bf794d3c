"""Samples on the server's host through the shared-memory region of a sample call stream.

``ReplayClient.sample`` from a client on the server's host sends its
SampleRequest on a call stream of its own (``sample_in_region``); the server
gathers the batch straight into the stream's region in /dev/shm and answers
where it lies; the client copies it out. The batch must be the one the plain
``Sample`` call gives (rows, ids, weights, mass), owned by the caller, with
the same errors, waiting and queue leases; where no region can be had (shared
memory off, another host, a batch over the region limit, a server without
the request) the plain call is made. Real server processes; regions live in a
directory of the test's own (``REPLAY_SHM_DIR``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from replay_client import ReplayClient, call_stream, chunked, errors
from replay_feed.shared_ring import SharedRing, host_id
from replay_proto.batch import SampleBatch
from replay_proto.sample_codec import encode_sample
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, start_server
from tests.integration.test_insert_regions import RawStream

CONFIG = """
[server]
shared_memory_mb = 128
shared_memory = {on}
max_batch_mb = 16

[[tables]]
name = "frames"
capacity = 4000
sampler = "prioritized"

[[tables]]
name = "queue"
capacity = 1000
sampler = "fifo"
lease_timeout_s = 60

[[tables]]
name = "empty"
capacity = 100
"""

ROWS = 600


def _server(tmp_path_factory, shm: Path, on: str = "true") -> ServerProcess:
    return start_server(tmp_path_factory.mktemp("server"), CONFIG.format(on=on),
                        env={"REPLAY_SHM_DIR": str(shm)})


def _frames(steps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows whose frame is a function of their step: a sampled row checks itself."""
    pattern = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (84, 84),
                                                                  dtype=np.uint8))
    frame = (pattern[None] + steps[:, None, None].to(torch.uint8)).to(torch.uint8)
    return {"frame": frame, "step": steps.clone()}


def _check_rows(batch) -> None:
    assert torch.equal(batch.columns["frame"], _frames(batch.columns["step"])["frame"])


@pytest.fixture(scope="module")
def shm(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def server(tmp_path_factory, shm: Path) -> Iterator[ServerProcess]:
    proc = _server(tmp_path_factory, shm)
    client = ReplayClient(proc.address)
    steps = torch.arange(ROWS)
    client.insert("frames", _frames(steps), priorities=1.0 + steps.double())
    client.close()
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess, shm: Path, monkeypatch) -> Iterator[ReplayClient]:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm))
    client = ReplayClient(server.address)
    yield client
    client.close()


def _plain_samples(monkeypatch) -> list[int]:
    """Counts the samples that went as plain calls (Sample or SampleChunks)."""
    made: list[int] = []
    plain = chunked.LargeAnswers._plain_sample

    def counted(self, table, batch_size, request, timeout):
        made.append(batch_size)
        return plain(self, table, batch_size, request, timeout)

    monkeypatch.setattr(chunked.LargeAnswers, "_plain_sample", counted)
    return made


def test_a_sample_goes_through_the_region_and_is_the_callers_own(
        client: ReplayClient, shm: Path, monkeypatch) -> None:
    plain = _plain_samples(monkeypatch)
    first = client.sample("frames", 256)
    session = client._stream("sample")._session
    assert session is not None and session.region is not None
    # sample_in_region (answered with the size needed), insert_region, region_answer,
    # sample_in_region
    assert session.sequence == 4
    assert session.region.slot_bytes == 2 << 20  # 1.8 MB: the next power of two
    assert plain == [] and os.listdir(shm) == []
    _check_rows(first)
    assert first.columns["frame"].shape == (256, 84, 84)
    assert first.mass is not None and first.mass.count == ROWS
    # The probabilities are the table's: priority ** alpha over their total.
    alpha = client.info()["frames"].alpha
    expected = (1.0 + first.columns["step"].double()) ** alpha / first.mass.total
    assert torch.allclose(first.probabilities, expected)
    offsets = first.ids - first.columns["step"]  # ids are consecutive over the steps
    assert torch.equal(offsets, offsets[:1].expand(256))
    kept = {key: tensor.clone() for key, tensor in first.columns.items()}
    for _ in range(3):
        _check_rows(client.sample("frames", 256))
    assert session.sequence == 7  # one message a sample once the region is there
    for key, tensor in kept.items():  # the first batch was copied out: untouched since
        assert torch.equal(first.columns[key], tensor)


def test_the_region_grows_for_a_larger_batch_and_the_largest_go_plain(
        client: ReplayClient, monkeypatch) -> None:
    plain = _plain_samples(monkeypatch)
    client.sample("frames", 8)
    session = client._stream("sample")._session
    assert session.region.slot_bytes == call_stream.SAMPLE_REGION_MIN_BYTES  # 56 KB asked
    batch = client.sample("frames", 1500)  # 10.6 MB: the server says how much, it grows
    _check_rows(batch)
    assert session.region.slot_bytes >= 16 << 20 and plain == []
    monkeypatch.setattr(call_stream, "REGION_MAX_BYTES", 8 << 20)
    with ReplayClient(client.address) as other:  # regions of at most 8 MiB here
        _check_rows(other.sample("frames", 8))
        _check_rows(other.sample("frames", 1500))
    assert plain == [1500]


@pytest.mark.parametrize("why", ["server off", "another host", "client off"])
def test_without_a_region_samples_are_plain_calls(tmp_path_factory, shm: Path, monkeypatch,
                                                  why: str) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm))
    proc = _server(tmp_path_factory, shm, on="false" if why == "server off" else "true")
    if why == "another host":
        monkeypatch.setattr(call_stream, "host_id", lambda: "another-host")
    if why == "client off":
        monkeypatch.setenv("REPLAY_SHARED_MEMORY", "0")
    plain = _plain_samples(monkeypatch)
    client = ReplayClient(proc.address)
    try:
        client.insert("frames", _frames(torch.arange(50)), priorities=torch.ones(50))
        for _ in range(3):
            _check_rows(client.sample("frames", 32))
        assert plain == [32, 32, 32]
        stream = client._stream("sample")
        said = {"server off": "shared_memory = false", "another host": "another host",
                "client off": "REPLAY_SHARED_MEMORY=0"}[why]
        assert said in stream._no_regions
        assert stream._session is None  # no call stream held open for nothing
        assert os.listdir(shm) == []
    finally:
        client.close()
        proc.stop()


def test_queue_rows_through_the_region_are_delivered_once(client: ReplayClient) -> None:
    client.insert("queue", _frames(torch.arange(1000, 1100)))
    seen: list[int] = []
    for _ in range(10):
        batch = client.sample("queue", 10)
        _check_rows(batch)
        seen += batch.columns["step"].tolist()
    assert seen == list(range(1000, 1100))  # in order, each once
    client.ack("queue")
    with pytest.raises(errors.EmptyTableError):
        client.sample("queue", 1, wait=False)


def test_a_sample_that_waits_gets_the_rows_inserted_meanwhile(client: ReplayClient) -> None:
    client.sample("frames", 1)  # the region is there
    with ReplayClient(client.address) as writer:
        timer = threading.Timer(0.3, lambda: writer.insert("queue", _frames(torch.arange(7))))
        timer.start()
        try:
            batch = client.sample("queue", 7, wait=True)
        finally:
            timer.join()
    assert batch.columns["step"].tolist() == list(range(7))
    client.ack("queue")


def test_refusals_through_the_region_keep_their_types(client: ReplayClient) -> None:
    with pytest.raises(errors.UnknownTableError):
        client.sample("nope", 4)
    with pytest.raises(errors.EmptyTableError):
        client.sample("empty", 4)
    with pytest.raises(errors.LimitExceededError, match="max_batch_mb"):
        client.sample("frames", 3000)  # 21 MB: over max_batch_mb = 16, region or not
    _check_rows(client.sample("frames", 16))  # the stream went on
    assert client._stream("sample")._session.region is not None


def test_bad_sample_requests_are_answered_in_band_drawing_nothing(
        client: ReplayClient, server: ServerProcess) -> None:
    before = client.info()["frames"].counters["sample_calls"]
    raw = RawStream(server.address)
    try:
        request = pb.SampleRequest(table="frames", batch_size=64).SerializeToString()
        answer = raw.ask("sample_in_region", request)  # no region yet: the size it needs
        assert not answer.sampled_in_region.batch
        assert answer.sampled_in_region.region_bytes >= 64 * 84 * 84
        assert raw.ask("sample_in_region", b"\xff\xff").error.code == "INVALID_ARGUMENT"
        zero = pb.SampleRequest(table="frames", batch_size=0).SerializeToString()
        answer = raw.ask("sample_in_region", zero)
        assert answer.error.code == "INVALID_ARGUMENT" and "batch_size" in answer.error.message
        ask = pb.SharedInsertRegion(host_id=host_id(), bytes=1 << 16).SerializeToString()
        offer = raw.ask("insert_region", ask).region_offer
        region = SharedRing.open(offer.name, offer.token, offer.slots, offer.slot_bytes,
                                 offer.header_bytes)
        raw.ask("region_answer", pb.SharedMemoryAnswer(accepted=True).SerializeToString())
        answer = raw.ask("sample_in_region", request)  # 452 KB into 64 KiB: too small
        assert not answer.sampled_in_region.batch
        assert answer.sampled_in_region.region_bytes > region.slot_bytes
        small = pb.SampleRequest(table="frames", batch_size=2).SerializeToString()
        answer = raw.ask("sample_in_region", small)
        header = pb.SampleResponse.FromString(answer.sampled_in_region.batch)
        assert header.batch_rows == 2 and list(header.shared_memory.offsets)
        region.close()
    finally:
        raw.close()
    assert client.info()["frames"].counters["sample_calls"] == before + 1  # only the last


def test_a_server_without_samples_in_regions_gets_plain_samples(monkeypatch) -> None:
    """A server from before ``sample_in_region`` ends the call at a request it cannot decode
    (INVALID_ARGUMENT): the sample is made as the plain call, and samples are not sent
    through a region again."""
    seen: list[str] = []
    rows = _frames(torch.arange(4))
    extras = [torch.arange(4), torch.ones(4), torch.full((4,), 0.25, dtype=torch.float64)]
    batch = SampleBatch.from_flat(rows, extras)

    def old_call_stream(requests, context):
        for raw in requests:
            request = pb.CallStreamRequest.FromString(raw)
            kind = request.WhichOneof("call")
            seen.append(str(kind))
            answer = pb.CallStreamResponse(sequence=request.sequence)
            if kind != "insert":  # what an old server's decoder makes of the new field
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed CallStreamRequest")
            yield answer.SerializeToString()

    def sample(raw: bytes, context) -> bytes:
        return encode_sample(batch, 0, 4 << 20)[0]

    stand_in = grpc.server(futures.ThreadPoolExecutor(4))
    stand_in.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "replay.v1.ReplayService", {
            "CallStream": grpc.stream_stream_rpc_method_handler(old_call_stream),
            "Sample": grpc.unary_unary_rpc_method_handler(sample)}),))
    port = stand_in.add_insecure_port("127.0.0.1:0")
    stand_in.start()
    plain = _plain_samples(monkeypatch)
    client = ReplayClient(f"127.0.0.1:{port}")
    try:
        for _ in range(2):
            got = client.sample("t", 4)
            assert torch.equal(got.columns["frame"], rows["frame"])
        assert plain == [4, 4]
        assert seen == ["sample_in_region"]  # asked once
    finally:
        client.close()
        stand_in.stop(None)
