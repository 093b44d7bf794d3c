"""Stored rows by position or id (``Read``, ``Write``) and how a table draws (``SetSampling``).

What TorchRL's buffer API needs beyond insert and sample: ``rb[index]``,
``rb[index] = data`` and checkpoints of a buffer read and overwrite stored
rows; ``rb.sampler.beta = x`` anneals a prioritized table and a seeded
generator makes its draws reproducible. A *position* is a
row's place in the table's storage (``0 .. capacity - 1``, in insertion order
from the table's creation or last reset, wrapping at capacity): TorchRL's
storage index. :class:`~replay_client.ReplayClient` delegates here.

A read of many rows is split into calls whose answers fit the message limit
(sized from the table's schema, read once per call of :func:`read`), so
memory stays bounded by the rows asked for. Reads and writes are retried
while the server is unavailable (repeating either changes nothing more).

Thread-safety: as the connection (safe to share).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replay_client.arguments import id_array
from replay_client.connection import Connection
from replay_client.errors import InvalidArgumentError
from replay_proto import row_codec
from replay_proto.batch import batch_nbytes
from replay_proto.dtype_names import ITEMSIZES
from replay_proto.row_codec import RowsRead
from replay_proto.rows import rows_of
from replay_proto.sample_codec import HEADROOM
from replay_proto.scalars import is_int, is_real
from replay_proto.v1 import replay_pb2 as pb

_EXTRA_BYTES_PER_ROW = 16
_MAX_ROWS_PER_CALL = 65_536
"""Rows one Read asks for at most (the request lists each position)."""


def read(connection: Connection, table: str, *, positions: Any = None, ids: Any = None,
         columns: bool = True, priorities: bool = False) -> RowsRead:
    """The stored rows at ``positions`` (or named by ``ids``), in the order given.

    Raises:
        InvalidArgumentError: neither or both of ``positions`` and ``ids``, or a
            position that holds no row (from the server).
        InvalidIdsError: an id that names no stored row. NoPrioritiesError, ...
    """
    if (positions is None) == (ids is None):
        raise InvalidArgumentError("read() takes positions=... or ids=..., exactly one")
    by_id = ids is not None
    values = id_array(ids) if by_id else _positions(positions)
    per_call = _rows_per_call(connection, table, columns)
    parts = []
    for start in range(0, max(values.size, 1), per_call):
        chunk = values[start:start + per_call]
        request = pb.ReadRequest(table=table, by_id=by_id, columns=columns,
                                 priorities=priorities)
        (request.ids if by_id else request.positions).extend(chunk.tolist())
        parts.append(row_codec.decode_read_response(
            connection.unary("Read", request.SerializeToString(), retry=True)))
    if len(parts) == 1:
        return parts[0]
    return RowsRead(
        {key: torch.cat([p.columns[key] for p in parts]) for key in parts[0].columns},
        torch.cat([p.ids for p in parts]),
        None if parts[0].priorities is None else torch.cat(
            [p.priorities for p in parts if p.priorities is not None]),
        parts[-1].size)


def write(connection: Connection, table: str, positions: Any, data: Any) -> int:
    """Overwrite the stored rows at ``positions`` with ``data`` (whole rows); returns the count."""
    values = _positions(positions)
    try:
        columns = {k: torch.as_tensor(v) for k, v in rows_of(data).items()}
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(str(exc)) from None
    raw = row_codec.encode_write(table, values, columns)
    return pb.WriteResponse.FromString(connection.unary("Write", raw, retry=True)).count


def set_sampling(connection: Connection, table: str, *, alpha: float | None = None,
                 beta: float | None = None, seed: int | None = None) -> tuple[float, float]:
    """How ``table`` draws from now on: a prioritized table's ``alpha`` and/or ``beta``,
    and/or the seed of its random generator. Returns ``(alpha, beta)`` in force."""
    request = pb.SetSamplingRequest(table=table)
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()  # schedulers hand out 0-d tensors
        if not is_real(value, numpy=True):
            raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
        setattr(request, name, float(value))
    if seed is not None:
        if not is_int(seed, numpy=True) or not 0 <= seed < 2**64:
            raise InvalidArgumentError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        request.seed = int(seed)
    answer = pb.SetSamplingResponse.FromString(
        connection.unary("SetSampling", request.SerializeToString(), retry=True))
    return answer.alpha, answer.beta


def _positions(positions: Any) -> np.ndarray:
    tensor = torch.as_tensor(positions).detach().cpu()
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.is_complex():
        raise InvalidArgumentError(f"positions must be integers, got {tensor.dtype}")
    return tensor.to(torch.int64).numpy().reshape(-1)


def _row_bytes(schema: dict[str, str]) -> int:
    """Bytes of one stored row of ``schema`` (specs such as ``"float32[17]"``, ``"bool[]"``)."""
    total = 0
    for spec in schema.values():
        dtype, _, dims = spec.partition("[")
        size = ITEMSIZES.get(dtype, 8)
        for dim in dims.rstrip("]").split(","):
            if dim.strip():
                size *= int(dim)
        total += size
    return total


def _rows_per_call(connection: Connection, table: str, columns: bool) -> int:
    """How many rows one Read answer can carry within the message limit."""
    room = connection.max_message_bytes - HEADROOM
    row = 0
    if columns:
        answer = pb.InfoResponse.FromString(
            connection.unary("Info", pb.InfoRequest().SerializeToString(), retry=True))
        for info in answer.tables:
            if info.name == table:
                row = batch_nbytes(_row_bytes(dict(info.schema)), 1)
    return max(1, min(_MAX_ROWS_PER_CALL, room // (row + _EXTRA_BYTES_PER_ROW)))
