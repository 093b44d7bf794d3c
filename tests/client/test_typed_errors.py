"""Every public failure of the client is a ReplayError subclass, raised before any network call
when the caller's own arguments are wrong; every error kind the server names has its class."""

from __future__ import annotations

import grpc
import pytest
import torch

from replay_client import ReplayClient, Writer, errors
from replay_proto.error_kinds import ERROR_KIND_KEY, ErrorKind

NOWHERE = "127.0.0.1:1"  # nothing listens: a call that reached the network would be Unavailable


@pytest.mark.parametrize("batch_size", ["32", 0, -1, 2.5, True, None])
def test_sample_refuses_a_bad_batch_size_before_sending(batch_size) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="batch_size"):
        ReplayClient(NOWHERE, timeout=1).sample("t", batch_size)


def test_argument_errors_are_also_value_errors() -> None:
    with pytest.raises(ValueError):
        ReplayClient(NOWHERE).sample("t", "32")


def test_an_address_that_is_not_a_string_is_refused() -> None:
    # (a list of addresses is a sharded client: tests/client/test_shards.py)
    for address in (5, {"a:1": 1}, b"a:1"):
        with pytest.raises(errors.InvalidArgumentError, match="host:port"):
            ReplayClient(address)  # type: ignore[arg-type]


@pytest.mark.parametrize("options,fragment", [
    ({"batch_rows": 0}, "batch_rows"),
    ({"batch_rows": "8"}, "batch_rows"),
    ({"batch_rows": 8, "max_pending_rows": 4}, "max_pending_rows"),
    ({"max_delay_s": 0}, "max_delay_s"),
    ({"max_delay_s": float("nan")}, "max_delay_s"),
    ({"episode_key": ""}, "episode_key"),
])
def test_writer_options_are_refused_with_a_typed_error(options, fragment) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=fragment):
        Writer(ReplayClient(NOWHERE), "t", **options)


def test_a_writer_step_that_differs_from_the_first_is_a_typed_error() -> None:
    class Sink:
        def insert(self, table, data):
            return torch.arange(len(next(iter(data.values()))))

    with Writer(Sink(), "t", batch_rows=4) as writer:
        writer.append({"obs": torch.zeros(3)})
        with pytest.raises(errors.InvalidArgumentError, match="key 'obs' was float32"):
            writer.append({"obs": torch.zeros(4)})


def test_stream_options_are_refused_before_any_call() -> None:
    client = ReplayClient(NOWHERE)
    for options in ({"prefetch": 0}, {"num_batches": -1}, {"batches_per_message": "2"},
                    {"pin_memory": "sometimes"}):
        with pytest.raises(errors.InvalidArgumentError):
            client.stream("t", 8, **options)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, kind: str | None) -> None:
        self._code, self._kind = code, kind

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"

    def trailing_metadata(self):
        return () if self._kind is None else ((ERROR_KIND_KEY, self._kind),)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_error_kind_maps_to_its_own_replay_error(kind: ErrorKind) -> None:
    error = errors.from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, kind.value), "a:1")
    assert isinstance(error, errors.ReplayError)
    assert type(error).__name__.lower().replace("error", "") != "replay"


def test_an_unknown_kind_falls_back_to_the_status_code() -> None:
    error = errors.from_rpc_error(_Failed(grpc.StatusCode.NOT_FOUND, "from_the_future"), "a:1")
    assert isinstance(error, errors.UnknownTableError)
