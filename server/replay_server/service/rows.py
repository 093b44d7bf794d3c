"""``Read``, ``Write`` and ``SetSampling``: rows by position or id, and how a table draws.

Thin handlers (decode, call the table, encode) for what TorchRL's buffer API
needs beyond insert and sample: ``rb[index]`` and checkpoints read stored
rows (:meth:`~replay_server.engine.table.Table.read_rows`), ``rb[index] = data``
overwrites them (:meth:`~replay_server.engine.table.Table.write_rows`), and
``rb.sampler.beta = x`` or a seeded generator change how a table draws
(:meth:`~replay_server.engine.table.Table.set_sampling`). Engine work runs
in the call runner's pool; a Read's answer is one message, so its size is
checked against the message limit before the rows are gathered, and its
memory is reserved while it is held.

Thread-safety: event-loop only (the engine work runs in the pool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from replay_proto import row_codec
from replay_proto.codec import CodecError
from replay_proto.sample_codec import HEADROOM
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import TableSet
from replay_server.service.budget import Reservation
from replay_server.service.calls import CallRunner
from replay_server.service.status import MessageTooLargeError

_EXTRA_BYTES_PER_ROW = 16
"""A read row's id and priority, beside its columns."""


class RowService:
    """The Read, Write and SetSampling handlers.

    Args:
        tables: the server's tables now (a function: a restore swaps them).
        calls: runs engine work.
        max_message_bytes: the gRPC message-size limit (a Read's answer must fit).
    """

    def __init__(self, tables: Callable[[], TableSet], calls: CallRunner,
                 max_message_bytes: int) -> None:
        self._tables = tables
        self._calls = calls
        self._max_message = max_message_bytes

    async def read(self, raw: bytes, context: grpc.aio.ServicerContext,
                   reservation: Reservation) -> bytes:
        return await self._calls.run(context, self._read, raw, reservation)

    def _read(self, raw: bytes, reservation: Reservation) -> bytes:
        request = _parse(pb.ReadRequest, raw)
        table = self._tables()[request.table]
        values = request.ids if request.by_id else request.positions
        count = len(values)
        schema = table.schema
        row_bytes = (schema.row_bytes if schema is not None and request.columns else 0)
        estimate = count * (row_bytes + _EXTRA_BYTES_PER_ROW)
        if estimate > self._max_message - HEADROOM:
            fit = (self._max_message - HEADROOM) // (row_bytes + _EXTRA_BYTES_PER_ROW)
            advice = (f"read at most {fit} rows per call" if fit else
                      "one row is over it: read fewer columns, or raise server.max_message_mb "
                      "(and the client's max_message_mb)")
            raise MessageTooLargeError(
                f"table {table.name!r}: reading {count} rows is about {estimate >> 20} MiB, over "
                f"the {self._max_message >> 20} MiB message limit; {advice}")
        reservation.resize(len(raw) + 2 * estimate, f"Read: {count} rows of {table.name!r}")
        array = np.fromiter(values, dtype=np.int64, count=count)
        found = table.read_rows(**{"ids" if request.by_id else "positions": array},
                                columns=request.columns, priorities=request.priorities)
        return row_codec.encode_read_response(found.columns, found.ids, found.priorities,
                                              found.size)

    async def write(self, raw: bytes, context: grpc.aio.ServicerContext,
                    reservation: Reservation) -> bytes:
        return await self._calls.change(context, self._write, raw)

    def _write(self, raw: bytes) -> tuple[str, bytes]:
        call = row_codec.decode_write(raw)
        self._tables()[call.table].write_rows(call.positions, call.columns)
        return call.table, pb.WriteResponse(count=call.positions.size).SerializeToString()

    async def set_sampling(self, raw: bytes, context: grpc.aio.ServicerContext,
                           reservation: Reservation) -> bytes:
        return await self._calls.change(context, self._set_sampling, raw)

    def _set_sampling(self, raw: bytes) -> tuple[str, bytes]:
        request = _parse(pb.SetSamplingRequest, raw)
        given = {name: getattr(request, name) for name in ("alpha", "beta", "seed")
                 if request.HasField(name)}
        alpha, beta = self._tables()[request.table].set_sampling(**given)
        return request.table, pb.SetSamplingResponse(alpha=alpha, beta=beta).SerializeToString()


def _parse(message_type: Any, raw: bytes) -> Any:  # a generated message class
    try:
        return message_type.FromString(raw)
    except Exception as exc:
        raise CodecError(f"malformed {message_type.__name__}: {exc}") from None
