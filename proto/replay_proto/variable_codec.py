"""Publish and Fetch bodies of replay.v1 (named variables), encoded and decoded in one place.

A variable's tensors travel like rows do (see :mod:`replay_proto.codec`): a
TensorSpec per tensor, their raw bytes in the payload, never a pickle. Keys
are a state dict's keys taken as they are (``"net.0.weight"`` is one key, not
a path). :func:`check_state` is the one definition of what a variable may
hold, used by the client before sending and by the server before storing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from replay_proto.chunks import payload_parts, scatter
from replay_proto.codec import (
    CodecError,
    decode_tensors,
    encode_tensors,
    expect_end,
    frame,
    spec_nbytes,
    split_payload,
    tensor_bytes,
)
from replay_proto.dtypes import DTYPES
from replay_proto.v1 import replay_pb2 as pb

_STORABLE = frozenset(DTYPES.values())

MAX_DIMS = 32
"""Most dimensions of one tensor of a variable (a checkpoint stores them through numpy)."""

MAX_KEY_CHARS = 1024
"""Longest key of a variable (a state dict's dotted names are far shorter)."""


class VariableFormatError(ValueError):
    """A state dict cannot be a variable; the message names the key and why."""


def check_state(state: Any) -> dict[str, torch.Tensor]:
    """``state`` as ``{key: tensor}`` if it can be a variable, else :class:`VariableFormatError`.

    A variable holds at least one dense tensor of a supported dtype and of
    at most :data:`MAX_DIMS` dimensions, under non-empty string keys of at
    most :data:`MAX_KEY_CHARS` characters; anything else (numbers, strings,
    nested dicts such as an optimizer's state, sparse or complex tensors) is
    refused. The same rules hold on both sides, so whatever a server accepts
    it can also checkpoint.
    """
    if not isinstance(state, Mapping):
        raise VariableFormatError(
            f"a variable is a mapping of key -> tensor (a state dict), got {type(state).__name__}")
    if not state:
        raise VariableFormatError("a variable needs at least one tensor, got an empty mapping")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if not isinstance(key, str) or not key:
            raise VariableFormatError(f"keys must be non-empty strings, got {key!r}")
        if len(key) > MAX_KEY_CHARS:
            raise VariableFormatError(
                f"key {key[:64]!r}... has {len(key)} characters, at most {MAX_KEY_CHARS} are "
                f"allowed")
        if not isinstance(tensor, torch.Tensor):
            raise VariableFormatError(
                f"key {key!r} holds a {type(tensor).__name__}; variables hold tensors only")
        if tensor.dtype not in _STORABLE or tensor.layout != torch.strided:
            raise VariableFormatError(
                f"key {key!r} has dtype {tensor.dtype} ({tensor.layout}); supported: dense "
                f"tensors of {', '.join(DTYPES)}")
        if tensor.dim() > MAX_DIMS:
            raise VariableFormatError(
                f"key {key!r} has {tensor.dim()} dimensions, at most {MAX_DIMS} are allowed")
        out[key] = tensor
    return out


@dataclass(frozen=True, slots=True)
class FetchAnswer:
    """A decoded Fetch answer (``found`` False: no newer version came in time)."""

    found: bool
    name: str
    version: int
    tensors: dict[str, torch.Tensor]


def publish_parts(name: str, tensors: Mapping[str, torch.Tensor]
                  ) -> tuple[pb.PublishRequest, list[memoryview]]:
    """A PublishRequest's header and payload buffers, not yet joined (one message, or
    chunks: :mod:`replay_proto.chunks`)."""
    specs, buffers = encode_tensors(tensors)
    return pb.PublishRequest(name=name, tensors=specs), buffers


def check_specs(specs: Sequence[pb.TensorSpec]) -> list[int]:
    """The byte size of each tensor ``specs`` describes, if they can be a variable.

    The wire's side of :func:`check_state`, with the same rules (at least one
    tensor, non-empty unique keys of at most :data:`MAX_KEY_CHARS`, supported
    dtypes, at most :data:`MAX_DIMS` dimensions), so a server checks a
    publish without building a tensor per key.

    Raises:
        VariableFormatError: naming the key and why.
    """
    if not specs:
        raise VariableFormatError("a variable needs at least one tensor, got none")
    sizes, seen = [], set()
    for spec in specs:
        key = spec.key
        if not key:
            raise VariableFormatError("keys must be non-empty strings, got ''")
        if len(key) > MAX_KEY_CHARS:
            raise VariableFormatError(
                f"key {key[:64]!r}... has {len(key)} characters, at most {MAX_KEY_CHARS} are "
                f"allowed")
        if key in seen:
            raise VariableFormatError(f"key {key!r} appears twice")
        seen.add(key)
        if len(spec.shape) > MAX_DIMS:
            raise VariableFormatError(
                f"key {key!r} has {len(spec.shape)} dimensions, at most {MAX_DIMS} are allowed")
        try:
            sizes.append(spec_nbytes(spec))
        except CodecError as exc:
            raise VariableFormatError(str(exc)) from None
    return sizes


def decode_publish_packed(raw: bytes) -> tuple[str, list[pb.TensorSpec], memoryview]:
    """``(name, specs, payload)`` of a Publish, checked (:func:`check_specs`), no tensor built.

    The payload is a view of ``raw`` holding exactly the tensors' bytes, in spec order.

    Raises:
        CodecError: the message is malformed, or its payload does not match the specs.
        VariableFormatError: the specs cannot be a variable.
    """
    header, payload = split_payload(raw, pb.PublishRequest)
    specs = list(header.tensors)
    expect_end(payload, sum(check_specs(specs)))
    return header.name, specs, payload


def encode_layout(specs: Sequence[pb.TensorSpec]) -> bytes:
    """The specs of a variable's tensors, encoded once (what :func:`encode_fetch_packed` sends)."""
    return pb.FetchResponse(tensors=specs).SerializeToString()


def decode_layout(layout: bytes) -> list[pb.TensorSpec]:
    """The specs :func:`encode_layout` encoded.

    Raises:
        CodecError: ``layout`` is malformed.
    """
    try:
        return list(pb.FetchResponse.FromString(layout).tensors)
    except Exception as exc:  # protobuf's DecodeError
        raise CodecError(f"malformed variable layout: {exc}") from None


def encode_fetch_packed(name: str, version: int, layout: bytes, data: Any) -> bytes:
    """A Fetch answer from a stored layout and its tensors' bytes (one copy of ``data``).

    Protobuf reads a message's fields in any order and repeated fields as they come,
    so the stored ``tensors`` field (the layout) is appended to the small header as is.
    """
    head = pb.FetchResponse(found=True, name=name, version=version).SerializeToString()
    return frame(head + layout, [data])


def fetch_packed_parts(name: str, version: int, layout: bytes, data: Any
                       ) -> tuple[pb.FetchResponse, list[memoryview]]:
    """A Fetch answer's header and payload from a stored layout and its tensors' bytes, not
    yet joined: what a chunked answer sends (:func:`replay_proto.chunks.frame_chunks`)."""
    header = pb.FetchResponse(found=True, name=name, version=version,
                              tensors=decode_layout(layout))
    return header, [memoryview(data).cast("B")]


def encode_not_newer(name: str) -> bytes:
    return pb.FetchResponse(found=False, name=name).SerializeToString()


def decode_fetch(raw: bytes) -> FetchAnswer:
    """The answer, its tensors copied out of ``raw`` (the caller owns them)."""
    header, payload = split_payload(raw, pb.FetchResponse)
    tensors, offset = decode_tensors(header.tensors, payload)
    expect_end(payload, offset)
    return FetchAnswer(header.found, header.name, header.version,
                       {key: t.clone() for key, t in tensors.items()})


def decode_fetch_chunks(messages: list[bytes]) -> FetchAnswer:
    """The answer of ``FetchChunks`` (one message, or a chunked transfer), its tensors
    copied out of the messages into one new tensor each (the caller owns them)."""
    header, parts = payload_parts(messages, pb.FetchResponse)
    if len(parts) == 1:
        return decode_fetch(messages[0])
    specs = list(header.tensors)
    keys = [spec.key for spec in specs]
    if len(set(keys)) != len(keys):
        raise CodecError("a key appears twice in a FetchResponse")
    needed = sum(spec_nbytes(spec) for spec in specs)
    if needed != header.payload_bytes:
        raise CodecError(f"payload has {header.payload_bytes} bytes but the tensors described "
                         f"need {needed}")
    tensors = {spec.key: torch.empty(tuple(spec.shape), dtype=DTYPES[spec.dtype])
               for spec in specs}
    scatter(parts, [tensor_bytes(t) for t in tensors.values()])
    return FetchAnswer(header.found, header.name, header.version, tensors)

