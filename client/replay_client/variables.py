"""Named variables on the client: publish a state dict, fetch the newest (or wait for a newer one).

A learner publishes its policy's ``state_dict()`` under a name; the server
gives each publish the next version of that name. Actors fetch the newest,
or block until one newer than theirs arrives, and load it with
``model.load_state_dict(variable)``: a :class:`Variable` is a dict of
tensors with the name and version attached. Only tensors travel (raw bytes
with dtype and shape, never a pickle), so a policy that cannot be pickled or
deep-copied reaches its actors all the same: they build their own module and
load the tensors into it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from replay_client.connection import Connection
from replay_client import chunked
from replay_client.errors import InvalidArgumentError, InvalidVariableError
from replay_proto import variable_codec
from replay_proto.scalars import is_int, is_real
from replay_proto.v1 import replay_pb2 as pb


class Variable(dict):
    """A fetched state dict (``{key: tensor}``, the tensors the caller's own) and its version.

    Attributes:
        name: the variable's name.
        version: its version (1 for the first publish of the name, then 2, ...).
    """

    def __init__(self, name: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.name = name
        self.version = version

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, version {self.version}, {len(self)} tensors)"


def publish(connection: Connection, name: str, state_dict: Any) -> int:
    """See :meth:`replay_client.ReplayClient.publish`."""
    if not isinstance(name, str) or not name:
        raise InvalidVariableError(f"the variable name must be a non-empty string, got {name!r}")
    try:
        tensors = variable_codec.check_state(state_dict)
    except variable_codec.VariableFormatError as exc:
        raise InvalidVariableError(f"variable {name!r}: {exc}") from None
    response = pb.PublishResponse.FromString(chunked.publish(connection, name, tensors))
    return int(response.version)


def fetch(answers: chunked.LargeAnswers, name: str, newer_than: int | None,
          timeout: float | None) -> Variable | None:
    """See :meth:`replay_client.ReplayClient.fetch`."""
    request = pb.FetchRequest(name=name)
    call_timeout = answers.connection.timeout
    if newer_than is not None:
        if not is_int(newer_than) or newer_than < 0:
            raise InvalidArgumentError(f"newer_than must be a version >= 0 or None, "
                                       f"got {newer_than!r}")
        if timeout is not None and (not is_real(timeout) or not 0 <= timeout < math.inf):
            raise InvalidArgumentError(f"timeout must be a number of seconds >= 0 or None, "
                                       f"got {timeout!r}")
        request.newer_than = newer_than
        request.timeout_s = math.inf if timeout is None else float(timeout)
        # The server answers by timeout_s; the call's own deadline leaves room for the transfer.
        call_timeout = None if timeout is None or call_timeout is None else timeout + call_timeout
    answer = answers.fetch(name, request.SerializeToString(), call_timeout)
    if not answer.found:
        return None
    return Variable(answer.name, answer.version, answer.tensors)
