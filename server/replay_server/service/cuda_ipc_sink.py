"""CUDA IPC's server side: a device table's batches gathered into a ring of device buffers.

Offered when the stream's table lives on a device (``device = "cuda"``), the
learner asked for ``cuda_ipc`` (its ask names its host, process and the GPUs
it sees: ``SampleStreamRequest.transport_asks``), runs on this host (the
ring's ``host_id``) in another process, sees the table's GPU, and the server
offers same-host rings (``server.shared_memory``). The ring is ``window + 1``
device buffers (one batch each) on the table's device, with two interprocess
events per slot: *written* (recorded by the server after it gathered a batch
into the slot) and *released* (recorded by the learner on its stream when it
gives the batch back). The offer carries the buffers' and events' handles
and the layout (keys, dtypes, shapes, offsets: the ring's
:class:`~replay_server.service.ring_sink.RingLayout`).

Batch ``k`` goes into slot ``k % slots``; the credit rule guarantees the
learner gave that slot's previous batch back (its *released* event recorded
before that credit was sent), and the server's stream waits on *released*
before the gather writes the slot, so an asynchronous learner still using
the slot on its GPU is never overwritten; nobody waits on the host. The
message carries only the slot. All same-host rings (shared memory and device
rings) together take at most ``server.shared_memory_mb``: a device ring
that would not fit is not offered (the first batch says why, naming the
setting) and the stream uses gRPC. The ring is freed when the stream ends
(or the learner refuses it).

The waits and gathers run on the engine threads' current stream (the default
stream), as every device table's work does: while it waits for a slow
learner to release a slot, later work queued on that stream waits too (a
device table's insert, which waits for its copies to land, among it). The
server is never more than the learner's window ahead, so this holds the
server to the pace of its slowest CUDA IPC learner's GPU work, no further. A
side stream would not: an insert could then overwrite rows a queued gather
has yet to read.

The device operations are :mod:`replay_feed.device_ipc`'s (CUDA, or a
simulation in tests). The learner's side is ``replay_client.cuda_ipc_source``.
Thread-safety: as every sink (:mod:`replay_server.service.batch_sink`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from replay_feed import device_ipc
from replay_feed.shared_ring import align, host_id
from replay_proto.batch import SampleBatch
from replay_proto.v1 import replay_pb2 as pb
from replay_server.engine import table_device
from replay_server.service.batch_sink import (
    Draw,
    SinkContext,
    transport_answer,
    transport_offer,
)
from replay_server.service.budget import Reservation
from replay_server.service.ring_sink import RingLayout
from replay_server.service.status import LimitExceededError, OverloadedError

if TYPE_CHECKING:
    from replay_server.service.settings import ServerSettings

NAME = "cuda_ipc"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` as ``"float32"`` (how the offer names dtypes)."""
    return str(dtype).removeprefix("torch.")


def slot_views(buffer: torch.Tensor, offsets: list[int],
               specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The tensors of one batch as views of a uint8 slot ``buffer`` (at ``offsets``)."""
    views = []
    for offset, (dtype, shape) in zip(offsets, specs):
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        views.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
    return views


class CudaIpcSink:
    """One stream's device ring (see the module docstring); made by :data:`CUDA_IPC`.

    Args:
        context: the stream's sink context.
        device: the table's device.
        uuid: that device's UUID (the learner opens the handles on its device of it).
    """

    name = NAME

    def __init__(self, context: SinkContext, device: torch.device, uuid: str) -> None:
        self._context = context
        self._device = device
        self._uuid = uuid
        self._ipc = device_ipc.backend()
        self._slots: list[torch.Tensor] = []
        self._written: list[Any] = []
        self._released: list[Any] = []
        self._uses: list[int] = []  # batches written into each slot so far
        self._layout: RingLayout | None = None
        self._reservation: Reservation | None = None

    def group(self, wanted: int, batch_size: int, batch_bytes: int) -> int:
        return 1  # one batch per slot

    def held_bytes(self, count: int, batch_bytes: int, extras: int) -> int:
        return extras

    def offer(self, batch: SampleBatch, batch_size: int) -> tuple[bytes, str]:
        context = self._context
        layout = RingLayout(batch, batch_size)
        slots = context.window + 1
        size = slots * align(layout.slot_bytes)
        try:
            reservation = context.limits.shared_memory_budget.reserve(
                size, f"a device ring of {slots} batches", owner=context.owner)
        except (OverloadedError, LimitExceededError) as exc:
            context.log("cuda_ipc_over_budget", logging.INFO,
                        f"no CUDA IPC ring ({exc}); using host copies")
            return b"", f"no CUDA IPC ring: {exc}"
        ipc, device = self._ipc, self._device
        try:
            for _ in range(slots):
                self._slots.append(ipc.buffer(layout.slot_bytes, device))
                self._written.append(ipc.event(device))
                self._released.append(ipc.event(device))
            params = {
                "uuid": self._uuid, "slots": slots, "slot_bytes": layout.slot_bytes,
                "keys": layout.keys, "dtypes": [dtype_name(d) for d, _ in layout.specs],
                "shapes": [list(s) for _, s in layout.specs], "offsets": layout.offsets,
                "buffers": [ipc.export_buffer(b) for b in self._slots],
                "written": [ipc.export_event(e) for e in self._written],
                "released": [ipc.export_event(e) for e in self._released],
            }
        except (device_ipc.IpcError, RuntimeError) as exc:
            reservation.release()
            self.close()
            context.log("cuda_ipc_failed", logging.WARNING,
                        f"no CUDA IPC ring ({exc}); using host copies")
            return b"", f"the server could not make a CUDA IPC ring: {exc}"
        self._uses = [0] * slots
        self._layout, self._reservation = layout, reservation
        return transport_offer(NAME, json.dumps(params).encode()), ""

    def answered(self, message: pb.SampleStreamRequest) -> bool | None:
        answer = transport_answer(NAME, message)
        if answer is None or self._layout is None:
            return None
        if answer.accepted:
            return True
        self._context.log("cuda_ipc_refused", logging.INFO, f"the learner refused the CUDA IPC "
                          f"ring ({answer.reason}); using host copies")
        self.close()
        return False

    def send(self, draw: Draw, index: int, count: int) -> tuple[list[bytes], int, SampleBatch]:
        layout = self._layout
        assert layout is not None
        ipc, device = self._ipc, self._device
        slot = index % len(self._slots)
        if self._uses[slot]:
            ipc.wait(self._released[slot], device)  # the learner's work on it is done first
        views = slot_views(self._slots[slot], layout.offsets, layout.specs)
        n = len(layout.keys)
        columns = dict(zip(layout.keys, views[:n]))
        batch, _ = draw(1, columns)
        for dest, src in zip(views[n:], batch.extras):
            dest.copy_(src)
        ipc.record(self._written[slot], device)
        self._uses[slot] += 1
        header = pb.SampleResponse(
            batch_index=index, batch_rows=int(batch.ids.shape[0]), last_chunk=True,
            batch_count=1, transport_batch=str(slot).encode(),
            mass=None if batch.mass is None else batch.mass.to_proto())
        return [header.SerializeToString()], 1, batch

    def close(self) -> None:
        objects: list[Any] = [*self._slots, *self._written, *self._released]
        self._slots, self._written, self._released = [], [], []
        self._layout = None
        reservation, self._reservation = self._reservation, None
        if objects:
            self._ipc.close(objects)
        if reservation is not None:
            reservation.release()


def parse_ask(first: pb.SampleStreamRequest) -> dict[str, Any] | None:
    """The learner's CUDA IPC ask in its first message (``None``: it did not ask)."""
    if NAME not in first.transports or NAME not in first.transport_asks:
        return None
    try:
        ask = json.loads(first.transport_asks[NAME])
    except ValueError:
        return None
    return ask if isinstance(ask, dict) else None


class CudaIpcSinks:
    """CUDA IPC's entry in the sink registry: a device ring for a learner process on this
    host that sees the GPU of the stream's device table."""

    name = NAME

    def open(self, context: SinkContext) -> tuple[CudaIpcSink | None, str]:
        ask = parse_ask(context.first)
        if ask is None:
            return None, ""
        table = context.table
        device = None if table is None else table_device(table.config)
        if device is None:
            return None, ""  # a host table: the shared-memory ring serves it (no note)
        if not context.limits.shared_memory:
            return None, "no CUDA IPC: the server has shared_memory = false"
        if ask.get("host_id") != host_id():
            return None, "no CUDA IPC: the learner runs on another host"
        if ask.get("pid") == os.getpid():
            return None, ""  # the server's own process: nothing to share
        ipc = device_ipc.backend()
        try:
            uuid = ipc.device_uuid(device)
        except Exception as exc:  # a device that cannot say: no IPC
            return None, f"no CUDA IPC: the table's device has no UUID ({exc})"
        if uuid not in ask.get("devices", []):
            return None, f"no CUDA IPC: the learner does not see the table's GPU {uuid}"
        return CudaIpcSink(context, device, uuid), ""

    def prepare(self, settings: ServerSettings) -> None:
        pass  # device memory goes with the process that held it


CUDA_IPC = CudaIpcSinks()
