"""Named variables under attack, through a real server process: a publish that poisons every
checkpoint, and many small keys against the variables budget.

Issue 23, finding 1: one raw ``Publish`` of a tensor of more than 64
dimensions was accepted; from then on every checkpoint failed with INTERNAL,
the one at SIGTERM included (exit 1, acknowledged rows lost). Now a variable
is checked like a table row (dimensions, key lengths, repeated keys) before
it is stored, so whatever is stored can be checkpointed.

Finding 7: the budget counted each key at 64 bytes plus its tensor, while
each key cost several hundred bytes of memory (400,000 keys charged 29 MiB,
RSS +637 MiB). Now a variable is held packed (one buffer, its specs encoded
once) and charged exactly that; here the server's RSS growth is measured
against ``variables_max_mb`` after it has been filled with small keys.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import psutil
import pytest
import torch

from replay_client import ReplayClient, errors
from replay_proto.codec import frame
from replay_proto.v1 import replay_pb2 as pb
from tests.conftest import ServerProcess, start_server

KIND_KEY = "replay-error-kind"
ROWS = 300


def config(tmp_path, budget_mb: int = 8) -> str:
    return f"""
[server]
checkpoint_dir = "{tmp_path / 'ckpt'}"
checkpoint_interval_s = 0
variables_max_mb = {budget_mb}

[[tables]]
name = "replay"
capacity = 1000
"""


def raw_publish(address: str, name: str, specs: list[pb.TensorSpec], payload: bytes):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/replay.v1.ReplayService/Publish")
        return call(frame(pb.PublishRequest(name=name, tensors=specs), [payload]), timeout=20)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[ServerProcess]:
    """One server for the refusals (a server's start is seconds of importing torch); it must
    still stop with exit 0 once they are all done."""
    tmp = tmp_path_factory.mktemp("variables")
    server = start_server(tmp, config(tmp))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _refused_publish(address: str, specs: list[pb.TensorSpec]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        raw_publish(address, "policy", specs, b"\0" * 4 * len(specs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


@pytest.mark.parametrize("dims", [65, 33, 10_000])
def test_a_publish_no_checkpoint_could_hold_is_refused_and_checkpoints_go_on(
        shared, dims: int) -> None:
    client = ReplayClient(shared.address)
    client.publish("policy", {"w": torch.ones(3)})
    refused = _refused_publish(shared.address,
                               [pb.TensorSpec(key="w", dtype="float32", shape=[1] * dims)])
    assert f"{dims} dimensions" in refused.details()
    assert dict(refused.trailing_metadata())[KIND_KEY] in (
        "invalid_variable", "malformed_request")
    ids = client.insert("replay", {"x": torch.arange(float(ROWS))})
    assert len(ids) == ROWS
    assert client.checkpoint()  # not poisoned


def test_after_a_refused_publish_shutdown_keeps_every_row(tmp_path) -> None:
    server = start_server(tmp_path, config(tmp_path))
    try:
        client = ReplayClient(server.address)
        client.publish("policy", {"w": torch.ones(3)})
        _refused_publish(server.address, [pb.TensorSpec(key="w", dtype="float32",
                                                        shape=[1] * 65)])
        client.insert("replay", {"x": torch.arange(float(ROWS))})
        assert client.checkpoint()
        client.insert("replay", {"x": torch.arange(float(ROWS))})
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    again = start_server(tmp_path, config(tmp_path), name="again")
    try:
        client = ReplayClient(again.address)
        assert client.info()["replay"].size == 2 * ROWS  # the shutdown checkpoint holds all
        assert client.fetch("policy").version == 1
    finally:
        again.stop()


@pytest.mark.parametrize("specs, why", [
    ([pb.TensorSpec(key="w", dtype="float32", shape=[1]),
      pb.TensorSpec(key="w", dtype="float32", shape=[1])], "appears twice"),
    ([pb.TensorSpec(key="k" * 2000, dtype="float32", shape=[1])], "2000 characters"),
])
def test_repeated_and_overlong_keys_are_refused(shared, specs, why: str) -> None:
    assert why in _refused_publish(shared.address, specs).details()


KEYS_PER_PUBLISH = 50_000
RSS_SLACK_MIB = 64
"""Freed request buffers the server's heap keeps for the next ones (app/heap.py), plus the
parse of one publish of 50,000 keys."""


def many_keys(prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.layer{i}.weight": torch.zeros(1) for i in range(KEYS_PER_PUBLISH)}


@pytest.mark.parametrize("budget_mb", [16, pytest.param(256, marks=pytest.mark.slow)])
def test_many_small_keys_cost_no_more_memory_than_the_budget_charges(
        tmp_path, budget_mb: int) -> None:
    server = start_server(tmp_path, config(tmp_path, budget_mb))
    try:
        client = ReplayClient(server.address, timeout=60)
        process = psutil.Process(server.process.pid)
        client.publish("warm", {"w": torch.zeros(1)})
        before = process.memory_info().rss
        keys = 0
        for n in range(1000):  # bounded: the budget refuses long before
            try:
                client.publish(f"v{n}", many_keys(f"v{n}"))
            except errors.VariableBudgetError:
                break
            keys += KEYS_PER_PUBLISH
        else:
            pytest.fail("the variables budget never refused a publish")
        grown = process.memory_info().rss - before
        print(f"{keys:,} keys stored under variables_max_mb = {budget_mb}: RSS "
              f"+{grown / 2**20:.1f} MiB")
        assert keys >= 4 * KEYS_PER_PUBLISH  # small keys are cheap to hold ...
        # ... and charged what they hold (within a tenth, for the heap's own bookkeeping)
        assert grown <= (1.1 * budget_mb + RSS_SLACK_MIB) * 2**20
        assert client.fetch("v0")["v0.layer7.weight"].shape == (1,)
        assert client.checkpoint()
    finally:
        assert server.stop() == 0
