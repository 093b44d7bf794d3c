"""A first insert cannot fix a table's schema to nonsense: real server, raw requests.

Issue 10, findings 7-9: colliding flat keys (``a``, ``a-b``, ``a.b``: the
old check compared only sorted neighbours, and ``-`` sorts between) were
accepted and every later sample failed; a row shape ``[0, 2**40]`` with an
empty payload fixed a schema; a schema needing 400 GB at the table's
capacity was answered INTERNAL. Each is now refused with a clear error, the
table is left as it was, and it then takes a good insert.

Requests are built with the wire codec directly, as a non-Python client
would send them (the Python client refuses the first two itself).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto.codec import frame
from replay_proto.error_kinds import ERROR_KIND_KEY
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, module_server
from tests.wire import encode_insert

CONFIG = """
[[tables]]
name = "keys"
capacity = 100

[[tables]]
name = "shapes"
capacity = 100

[[tables]]
name = "big"
capacity = 10_000_000
"""

server = module_server(CONFIG)


def raw_insert(server: ServerProcess, raw: bytes) -> grpc.RpcError:
    """Send an Insert of raw bytes; the error it was refused with."""
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/replay.v1.ReplayService/Insert")(raw, timeout=30)
    return info.value


def kind(error: grpc.RpcError) -> str:
    return dict(error.trailing_metadata())[ERROR_KIND_KEY]


def assert_takes_a_good_insert(client: ReplayClient, table: str) -> None:
    ids = client.insert(table, {"obs": torch.arange(8.0).unsqueeze(1)})
    batch = client.sample(table, 16)
    assert set(batch.ids.tolist()) <= set(ids.tolist())
    assert client.info()[table].schema == {"obs": "float32[1]"}


def test_keys_colliding_as_paths_are_refused_whatever_sorts_between(server) -> None:
    client = ReplayClient(server.address)
    columns = {"a": torch.zeros(2), "a-b": torch.ones(2), "a.b": torch.full((2,), 2.0)}
    error = raw_insert(server, encode_insert("keys", columns))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and kind(error) == "invalid_argument"
    assert "key 'a' is both a value and the parent of 'a.b'" in error.details()
    with pytest.raises(errors.InvalidArgumentError, match="both a value and the parent"):
        client.insert("keys", columns)  # the client refuses it before sending, too
    assert client.info()["keys"].schema == {} and client.info()["keys"].size == 0
    assert_takes_a_good_insert(client, "keys")


def test_a_zero_size_or_absurd_row_shape_cannot_fix_the_schema(server) -> None:
    client = ReplayClient(server.address)
    header = pb.InsertRequest(table="shapes", columns=[
        pb.TensorSpec(key="obs", dtype="float32", shape=[1, 0, 2**40])])
    error = raw_insert(server, frame(header, []))  # no payload: the shape holds no element
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 'obs' cannot fix the table's schema" in error.details()
    assert "every dimension of a row must be an integer >= 1, got shape [0, 1099511627776]" \
        in error.details()
    error = raw_insert(server, encode_insert("shapes", {"x": torch.zeros(2, 0)}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "got shape [0]" in error.details()
    assert client.info()["shapes"].schema == {}
    assert_takes_a_good_insert(client, "shapes")


def test_a_schema_needing_more_memory_than_the_machine_is_refused_clearly(server) -> None:
    client = ReplayClient(server.address)
    # 40 KB rows at a capacity of 10 million: 400 GB.
    with pytest.raises(errors.LimitExceededError) as info:
        client.insert("big", {"obs": torch.zeros(2, 10_000)})
    message = str(info.value)
    assert "table 'big': capacity 10,000,000 x 40,000 bytes per row" in message
    assert "372.5 GiB" in message and "lower the table's capacity or its row size" in message
    assert client.info()["big"].schema == {} and client.info()["big"].storage_bytes == 0
    assert_takes_a_good_insert(client, "big")
