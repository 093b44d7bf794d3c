"""Waiting priority updates from the server's host over a Unix socket instead of gRPC.

A client's update call stream asks for a local channel; its waiting updates
then travel over a Unix socket (mode 0600, in the server's shared-memory
directory) that only a token handed out on the authenticated stream opens.
The updates must do exactly what they do on the stream (counts, priorities,
typed errors); a peer without a token, with a used one, or sending anything
but update frames is closed with nothing applied; and where no channel can
be had the updates take the call stream as before. Real server processes;
the socket lives in a directory of the test's own (``REPLAY_SHM_DIR``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replay_client import ReplayClient, call_stream, errors
from replay_feed.shared_ring import host_id
from replay_proto import messages
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, start_server, wait_for
from tests.integration.test_insert_regions import RawStream

CONFIG = """
[server]
shared_memory = {on}

[[tables]]
name = "p"
capacity = 1000
sampler = "prioritized"
"""


def _server(tmp_path_factory, shm: Path, on: str = "true") -> ServerProcess:
    return start_server(tmp_path_factory.mktemp("server"), CONFIG.format(on=on),
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
    client.reset("p")
    yield client
    client.close()


def _stored(client: ReplayClient, n: int = 100) -> torch.Tensor:
    return client.insert("p", {"x": torch.arange(n, dtype=torch.float32)},
                         priorities=torch.ones(n))


def _priorities(client: ReplayClient, ids: torch.Tensor) -> list[float]:
    """The rows' priorities as stored (float32 in the tree: compared to 6 digits)."""
    return [round(p, 5) for p in client.read("p", ids=ids, priorities=True).priorities.tolist()]


def _local(client: ReplayClient):
    return client._stream("update_priorities")._local


def test_waiting_updates_go_over_the_socket_and_do_what_they_do_on_the_stream(
        client: ReplayClient, shm: Path) -> None:
    ids = _stored(client)
    applied = client.update_priorities("p", ids[:10], torch.arange(10, dtype=torch.float64) + 1)
    assert applied == 10
    sock = _local(client)._socket
    assert sock is not None  # the update went over the channel
    path = sock.getpeername()
    assert Path(path).parent == shm and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert _priorities(client, ids[:10]) == [float(k + 1) for k in range(10)]
    session = client._stream("update_priorities")._session
    asked = session.sequence  # local_channel only: the updates did not use the stream
    for k in range(5):
        assert client.update_priorities("p", ids[:3], torch.full((3,), 7.0 + k)) == 3
    assert session.sequence == asked and _local(client)._socket is sock
    assert _priorities(client, ids[:3]) == [11.0] * 3
    client.reset("p")  # the ids are gone: stale, counted as on the stream
    assert client.update_priorities("p", ids[:4], torch.ones(4)) == 0


def test_refusals_over_the_socket_keep_their_types(client: ReplayClient) -> None:
    ids = _stored(client)
    with pytest.raises(errors.UnknownTableError):
        client.update_priorities("nope", ids[:2], torch.ones(2))
    with pytest.raises(errors.InvalidPriorityError):
        client.update_priorities("p", ids[:2], torch.tensor([1.0, -1.0]))  # the client's check
    sock = _local(client)._socket
    assert sock is not None  # refused in-band: the channel goes on
    assert client.update_priorities("p", ids[:2], torch.ones(2)) == 2


def _offer(address: str) -> tuple[RawStream, pb.LocalChannelOffer]:
    raw = RawStream(address)
    ask = pb.LocalChannelRequest(host_id=host_id()).SerializeToString()
    return raw, raw.ask("local_channel", ask).local_channel


def _frame(ids: torch.Tensor, value: float) -> bytes:
    update = messages.encode_update("p", ids.numpy(), torch.full(ids.shape, value,
                                                               dtype=torch.float64).numpy())
    return _framed(messages.encode_call_request(0, "update_priorities", update))


def _framed(request: bytes) -> bytes:
    return struct.pack("<I", len(request)) + request


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_without_its_token_the_socket_applies_nothing(client: ReplayClient,
                                                       server: ServerProcess) -> None:
    ids = _stored(client)
    raw, offer = _offer(server.address)
    try:
        for token in (b"\0" * 16, offer.token[::-1]):  # none handed out
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(offer.path)
                sock.sendall(token + _frame(ids[:5], 9.0))
                assert _closed(sock)
        with socket.socket(socket.AF_UNIX) as sock:  # nothing sent: closed after 2 s
            sock.connect(offer.path)
            assert _closed(sock)
        with socket.socket(socket.AF_UNIX) as sock:  # the real token: applied
            sock.connect(offer.path)
            sock.sendall(offer.token + _frame(ids[:5], 3.0))
            length = struct.unpack("<I", sock.recv(4))[0]
            answer = pb.CallStreamResponse.FromString(sock.recv(length))
            assert answer.update_priorities.applied == 5
        with socket.socket(socket.AF_UNIX) as sock:  # a token is good once
            sock.connect(offer.path)
            sock.sendall(offer.token + _frame(ids[:5], 9.0))
            assert _closed(sock)
    finally:
        raw.close()
    assert _priorities(client, ids[:5]) == [3.0] * 5


def test_a_frame_that_is_not_an_update_or_too_large_closes_the_channel(
        client: ReplayClient, server: ServerProcess) -> None:
    ids = _stored(client)
    for bad in (struct.pack("<I", 1 << 20),  # over the stream's 64 KiB messages
                struct.pack("<I", 3) + b"\xff\xff\xff",  # not a CallStreamRequest
                _framed(messages.encode_call_request(0, "insert", b"xy"))):  # not an update
        raw, offer = _offer(server.address)
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(offer.path)
                sock.sendall(offer.token + bad)
                assert _closed(sock)
        finally:
            raw.close()
    assert client.update_priorities("p", ids[:2], torch.ones(2)) == 2  # still serving
    assert "Traceback" not in server.log()


def test_the_channel_ends_with_its_stream(client: ReplayClient, server: ServerProcess) -> None:
    raw, offer = _offer(server.address)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(offer.path)
    sock.sendall(offer.token)
    raw.close()  # the call stream ends
    assert _closed(sock)
    sock.close()


@pytest.mark.parametrize("why", ["server off", "another host", "client off"])
def test_without_a_channel_updates_take_the_stream(tmp_path_factory, shm: Path, monkeypatch,
                                                   why: str) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(shm))
    proc = _server(tmp_path_factory, shm, on="false" if why == "server off" else "true")
    if why == "another host":
        monkeypatch.setattr(call_stream, "host_id", lambda: "another-host")
    if why == "client off":
        monkeypatch.setenv("REPLAY_SHARED_MEMORY", "0")
    client = ReplayClient(proc.address)
    try:
        ids = _stored(client)
        for k in range(3):
            assert client.update_priorities("p", ids[:4], torch.full((4,), 2.0 + k)) == 4
        stream = client._stream("update_priorities")
        assert stream._local._socket is None
        said = {"server off": "shared_memory = false", "another host": "another host",
                "client off": "REPLAY_SHARED_MEMORY=0"}[why]
        assert said in stream._no_regions
        assert stream._session.sequence == 3 + (why != "client off")  # on the stream
        assert _priorities(client, ids[:4]) == [4.0] * 4
    finally:
        client.close()
        proc.stop()


def test_a_stopped_server_leaves_no_socket_behind(tmp_path_factory, tmp_path: Path,
                                                  monkeypatch) -> None:
    monkeypatch.setenv("REPLAY_SHM_DIR", str(tmp_path))
    proc = _server(tmp_path_factory, tmp_path)
    client = ReplayClient(proc.address)
    ids = _stored(client)
    assert client.update_priorities("p", ids[:2], torch.ones(2)) == 2
    assert _local(client)._socket is not None and os.listdir(tmp_path)
    proc.stop()
    assert wait_for(lambda: os.listdir(tmp_path) == [], timeout=10)
    with pytest.raises(errors.ReplayError):  # the server is gone: as any call to it
        ReplayClient(proc.address, timeout=2, max_retry_s=0).update_priorities(
            "p", ids[:2], torch.ones(2))
    client.close()
